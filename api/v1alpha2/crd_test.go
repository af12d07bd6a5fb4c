package v1alpha2_test

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	"github.com/tallyepp/tally/api/v1alpha2"
)

// crdDir holds the CRDs Tally ships, copied from upstream v1.5.0
// (test/manifests checks the copies).
var crdDir = filepath.Join("..", "..", "config", "crd", "bases")

// kinds are the types this package declares, each with its CRD file.
var kinds = []struct {
	file       string
	kind       string
	obj, list  runtime.Object
	objectType reflect.Type
}{
	{
		file: "inference.networking.x-k8s.io_inferenceobjectives.yaml", kind: v1alpha2.KindInferenceObjective,
		obj: &v1alpha2.InferenceObjective{}, list: &v1alpha2.InferenceObjectiveList{},
		objectType: reflect.TypeFor[v1alpha2.InferenceObjective](),
	},
	{
		file: "inference.networking.x-k8s.io_inferencemodelrewrites.yaml", kind: v1alpha2.KindInferenceModelRewrite,
		obj: &v1alpha2.InferenceModelRewrite{}, list: &v1alpha2.InferenceModelRewriteList{},
		objectType: reflect.TypeFor[v1alpha2.InferenceModelRewrite](),
	},
}

// schemaProps is the part of an OpenAPI v3 schema the comparison reads.
type schemaProps struct {
	Type       string                 `json:"type"`
	Properties map[string]schemaProps `json:"properties"`
	Required   []string               `json:"required"`
	Items      *schemaProps           `json:"items"`
}

type crd struct {
	Spec struct {
		Group string `json:"group"`
		Names struct {
			Kind     string `json:"kind"`
			ListKind string `json:"listKind"`
		} `json:"names"`
		Versions []struct {
			Name    string `json:"name"`
			Served  bool   `json:"served"`
			Storage bool   `json:"storage"`
			Schema  struct {
				OpenAPIV3Schema schemaProps `json:"openAPIV3Schema"`
			} `json:"schema"`
		} `json:"versions"`
	} `json:"spec"`
}

func readCRD(t *testing.T, file string) crd {
	t.Helper()
	path := filepath.Join(crdDir, file)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var c crd
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatalf("parsing %s: %v", path, err)
	}
	return c
}

func TestSchemeMatchesCRDNames(t *testing.T) {
	s := runtime.NewScheme()
	if err := v1alpha2.Install(s); err != nil {
		t.Fatal(err)
	}
	for _, k := range kinds {
		t.Run(k.kind, func(t *testing.T) {
			c := readCRD(t, k.file)
			for obj, kind := range map[runtime.Object]string{
				k.obj:  c.Spec.Names.Kind,
				k.list: c.Spec.Names.ListKind,
			} {
				gvks, _, err := s.ObjectKinds(obj)
				if err != nil {
					t.Fatal(err)
				}
				want := v1alpha2.SchemeGroupVersion.WithKind(kind)
				if len(gvks) != 1 || gvks[0] != want {
					t.Errorf("%T registers as %v, want %v (the CRD's)", obj, gvks, want)
				}
			}
			if c.Spec.Names.Kind != k.kind {
				t.Errorf("the Kind constant is %q, the CRD says %q", k.kind, c.Spec.Names.Kind)
			}
			if c.Spec.Group != v1alpha2.GroupName {
				t.Errorf("GroupName = %q, the CRD says %q", v1alpha2.GroupName, c.Spec.Group)
			}
		})
	}
}

// TestTypesMatchCRDSchema walks each CRD's schema and our Go types side by
// side: every property has a field with that json name and a matching type,
// every field has a property (else the API server prunes it silently), and
// the CRD's required properties are exactly the fields without omitempty.
func TestTypesMatchCRDSchema(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.kind, func(t *testing.T) {
			c := readCRD(t, k.file)
			var found bool
			for _, v := range c.Spec.Versions {
				if v.Name != v1alpha2.SchemeGroupVersion.Version {
					continue
				}
				found = true
				if !v.Served || !v.Storage {
					t.Errorf("version %s: served=%v storage=%v, want both", v.Name, v.Served, v.Storage)
				}
				compare(t, "", k.objectType, v.Schema.OpenAPIV3Schema)
			}
			if !found {
				t.Fatalf("%s has no version %s", k.file, v1alpha2.SchemeGroupVersion.Version)
			}
		})
	}
}

var (
	jsonMarshaler = reflect.TypeFor[json.Marshaler]()
	objectMeta    = reflect.TypeFor[metav1.ObjectMeta]()
)

func compare(t *testing.T, path string, typ reflect.Type, s schemaProps) {
	t.Helper()
	for typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	// A type with its own JSON form (metav1.Time) is a string in the schema.
	if typ.Implements(jsonMarshaler) || reflect.PointerTo(typ).Implements(jsonMarshaler) {
		if s.Type != "string" {
			t.Errorf("%s: Go %s marshals itself, the CRD says type %q, want string", path, typ, s.Type)
		}
		return
	}
	var want string
	switch typ.Kind() {
	case reflect.Struct:
		want = "object"
	case reflect.Slice:
		want = "array"
	case reflect.String:
		want = "string"
	case reflect.Int, reflect.Int32, reflect.Int64:
		want = "integer"
	case reflect.Bool:
		want = "boolean"
	default:
		t.Errorf("%s: Go %s has no schema type this test knows", path, typ)
		return
	}
	if s.Type != want {
		t.Errorf("%s: Go %s is %s, the CRD says type %q", path, typ, want, s.Type)
		return
	}
	switch typ.Kind() {
	case reflect.Slice:
		if s.Items == nil {
			t.Errorf("%s: array without items", path)
			return
		}
		compare(t, path+"[]", typ.Elem(), *s.Items)
	case reflect.Struct:
		// The API server validates metadata itself; the CRD only says object.
		if typ == objectMeta {
			return
		}
		fields := jsonFields(typ)
		names := slices.Sorted(maps.Keys(fields))
		props := slices.Sorted(maps.Keys(s.Properties))
		if !slices.Equal(names, props) {
			t.Errorf("%s: Go %s has json fields %q, the CRD has properties %q", path, typ, names, props)
		}
		var required []string
		for name, f := range fields {
			if !f.omitempty {
				required = append(required, name)
			}
		}
		slices.Sort(required)
		if wantReq := slices.Sorted(slices.Values(s.Required)); !slices.Equal(required, wantReq) {
			t.Errorf("%s: Go %s has fields without omitempty %q, the CRD requires %q", path, typ, required, wantReq)
		}
		for _, name := range names {
			if p, ok := s.Properties[name]; ok {
				compare(t, strings.TrimPrefix(path+"."+name, "."), fields[name].typ, p)
			}
		}
	}
}

type jsonField struct {
	typ       reflect.Type
	omitempty bool
}

// jsonFields returns the fields of struct typ by json name, with the fields
// of inline (embedded, unnamed) structs merged in, as encoding/json does.
func jsonFields(typ reflect.Type) map[string]jsonField {
	out := map[string]jsonField{}
	for f := range typ.Fields() {
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if name == "" && f.Anonymous {
			maps.Copy(out, jsonFields(f.Type))
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = jsonField{typ: f.Type, omitempty: slices.Contains(strings.Split(opts, ","), "omitempty")}
	}
	return out
}
