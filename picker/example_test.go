package picker_test

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/tallyepp/tally/api/v1alpha1"
	"github.com/tallyepp/tally/picker"
)

// A reservation's lifecycle: Admit places the request and reserves its
// prefill on the chosen endpoint; the first response bytes end the
// prefill; End releases the rest with what the response said.
func Example_reservationLifecycle() {
	// A clock that stands still, so that the drain model finishes no
	// prefill while the example prints.
	clock := testingclock.NewFakeClock(time.Now())
	p := picker.New(v1alpha1.Default(), picker.Options{Clock: clock})
	p.Replace([]picker.Endpoint{
		{Pod: "vllm-0", Address: netip.MustParseAddrPort("10.0.0.1:8000")},
		{Pod: "vllm-1", Address: netip.MustParseAddrPort("10.0.0.2:8000")},
	})

	r, err := p.Admit(context.Background(), picker.Request{Model: "llama", Prompt: make([]byte, 4000), Stream: true})
	if err != nil {
		panic(err)
	}
	fmt.Println("placed:", len(r.Endpoints()) > 0)
	fmt.Println("in flight:", p.Snapshot().InFlight, "prefill tokens:", p.Snapshot().PrefillTokens)

	p.FirstByte(r) // the endpoint computed the prompt: the request decodes
	fmt.Println("prefill tokens after the first byte:", p.Snapshot().PrefillTokens)

	p.End(r, picker.Outcome{PromptTokens: 1000, CompletionTokens: 64})
	fmt.Println("in flight after the end:", p.Snapshot().InFlight)
	// Output:
	// placed: true
	// in flight: 1 prefill tokens: 1000
	// prefill tokens after the first byte: 0
	// in flight after the end: 0
}

// A gateway that asks only where a request goes (NGINX Gateway Fabric's
// shim) ends the stream at the pick: the reservation is detached and stays
// in the ledger until the model says the request is done.
func Example_detachedReservation() {
	p := picker.New(v1alpha1.Default(), picker.Options{})
	p.Replace([]picker.Endpoint{{Pod: "vllm-0", Address: netip.MustParseAddrPort("10.0.0.1:8000")}})

	r, err := p.Admit(context.Background(), picker.Request{Model: "llama", Prompt: make([]byte, 4000), MaxTokens: 128})
	if err != nil {
		panic(err)
	}
	p.End(r, picker.Outcome{Detached: true})
	s := p.Snapshot()
	fmt.Println("in flight:", s.InFlight, "detached:", s.Detached)
	// Output:
	// in flight: 1 detached: 1
}
