package envoy

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestApplyHeaderMutation(t *testing.T) {
	set := func(key, value string, action corev3.HeaderValueOption_HeaderAppendAction) *corev3.HeaderValueOption {
		return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: key, RawValue: []byte(value)}, AppendAction: action}
	}
	h := http.Header{"A": {"1"}, "B": {"2"}, "C": {"3"}, "D": {"4"}, "Gone": {"x"}}
	err := ApplyHeaderMutation(h, &extprocv3.HeaderMutation{
		RemoveHeaders: []string{"gone"},
		SetHeaders: []*corev3.HeaderValueOption{
			set("a", "new", corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD), // unset action: overwrite, as Envoy
			set("b", "new", corev3.HeaderValueOption_ADD_IF_ABSENT),
			{Header: &corev3.HeaderValue{Key: "c", RawValue: []byte("more")}, Append: wrapperspb.Bool(true)},
			set("d", "new", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS),
			set("e", "new", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS),
			set("f", "new", corev3.HeaderValueOption_ADD_IF_ABSENT),
			{Header: &corev3.HeaderValue{Key: ":path", Value: "/rewritten"}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := http.Header{"A": {"new"}, "B": {"2"}, "C": {"3", "more"}, "D": {"new"}, "F": {"new"}, ":path": {"/rewritten"}}
	if fmt.Sprint(h) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v", h, want)
	}

	err = ApplyHeaderMutation(h, &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		{Header: &corev3.HeaderValue{Key: "c", RawValue: []byte("again")}, AppendAction: corev3.HeaderValueOption_ADD_IF_ABSENT},
		{Header: &corev3.HeaderValue{Key: "both", Value: "v", RawValue: []byte("r")}},
	}})
	if err == nil || !strings.Contains(err.Error(), "both") {
		t.Errorf("a header with value and raw_value: err %v, want one naming it", err)
	}
}
