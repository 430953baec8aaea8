package api

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/spacedev/space/internal/fault"
)

// routeDirs hold the HTTP code of the control plane and the data plane: every non-test
// .go file in them is scanned for route registrations, so a route added in a new file
// cannot escape the document.
var routeDirs = []string{"../internal/server", "../internal/dataplane"}

// routeDir names the scanned directories in messages.
var routeDir = strings.Join(routeDirs, ", ")

// routeFiles lists the non-test Go files of routeDirs.
func routeFiles(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, dir := range routeDirs {
		entries, err := os.ReadDir(filepath.FromSlash(dir))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			name := e.Name()
			if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
				continue
			}
			out = append(out, filepath.Join(filepath.FromSlash(dir), name))
		}
	}
	if len(out) == 0 {
		t.Fatalf("%s: no Go files", routeDir)
	}
	return out
}

// mustRegister are files known to register routes; finding none in one of them means
// the registration forms changed and routeFuncs must follow.
var mustRegister = []string{"server.go", "dataplane.go", "files.go", "templates.go"}

// routeFuncs are the calls whose first argument is a route pattern: the mux's own
// methods (server.go), the API-key wrapper authed, a local closure in API.Handler that
// registerFiles and registerTemplates receive as a parameter of the same name, and the
// data plane's error-handling wrapper h (dataplane.go).
var routeFuncs = map[string]bool{"mux.HandleFunc": true, "mux.Handle": true, "authed": true, "h": true}

var httpMethods = map[string]bool{"get": true, "put": true, "post": true, "delete": true, "options": true, "head": true, "patch": true, "trace": true}

type route struct {
	method string // "" matches every method
	path   string // in OpenAPI form
	src    string // the pattern as registered, with its position
}

func loadDoc(t *testing.T) map[string]any {
	t.Helper()
	var doc map[string]any
	if err := json.Unmarshal(OpenAPI, &doc); err != nil {
		t.Fatalf("OpenAPI is not JSON: %v", err)
	}
	return doc
}

// TestOpenAPIDocument guards the conversion done at package init and the document's
// top-level shape.
func TestOpenAPIDocument(t *testing.T) {
	// Strict conversion also rejects duplicate keys, which plain YAML decoding would
	// silently resolve to the last one.
	strict, err := yaml.YAMLToJSONStrict(openapiYAML)
	if err != nil {
		t.Fatalf("openapi.yaml: %v", err)
	}
	var a, b any
	if err := json.Unmarshal(strict, &a); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(OpenAPI, &b); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Error("OpenAPI differs from a fresh conversion of openapi.yaml")
	}

	doc := loadDoc(t)
	if v, _ := doc["openapi"].(string); !strings.HasPrefix(v, "3.") {
		t.Errorf("openapi = %q, want 3.x", v)
	}
	info, _ := doc["info"].(map[string]any)
	for _, k := range []string{"title", "version", "description"} {
		if s, _ := info[k].(string); s == "" {
			t.Errorf("info.%s is empty", k)
		}
	}

	// Tags, operation ids and security requirements refer to declared things.
	tags := map[string]bool{}
	for _, tg := range asSlice(doc["tags"]) {
		tags[str(tg, "name")] = true
	}
	schemes, _ := dig(doc, "components", "securitySchemes").(map[string]any)
	checkSecurity := func(where string, v any) {
		for _, req := range asSlice(v) {
			for name := range req.(map[string]any) {
				if _, ok := schemes[name]; !ok {
					t.Errorf("%s: unknown security scheme %q", where, name)
				}
			}
		}
	}
	checkSecurity("top level", doc["security"])
	opIDs := map[string]string{}
	forEachOperation(doc, func(method, path string, op map[string]any) {
		where := strings.ToUpper(method) + " " + path
		if len(asSlice(op["tags"])) == 0 {
			t.Errorf("%s has no tag", where)
		}
		for _, tg := range asSlice(op["tags"]) {
			if !tags[tg.(string)] {
				t.Errorf("%s: tag %q is not declared in tags", where, tg)
			}
		}
		if id, _ := op["operationId"].(string); id != "" {
			if prev, dup := opIDs[id]; dup {
				t.Errorf("operationId %q is used by %s and %s", id, prev, where)
			}
			opIDs[id] = where
		}
		if r, _ := op["responses"].(map[string]any); len(r) == 0 {
			t.Errorf("%s has no responses", where)
		}
		checkSecurity(where, op["security"])
	})
}

// serverRoutes extracts the route patterns registered in the files of routeDir.
func serverRoutes(t *testing.T) []route {
	t.Helper()
	var routes []route
	fset := token.NewFileSet()
	found := map[string]int{} // base name -> registrations
	for _, name := range routeFiles(t) {
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		ast.Inspect(f, func(node ast.Node) bool {
			call, ok := node.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			var fn string
			switch f := call.Fun.(type) {
			case *ast.Ident:
				fn = f.Name
			case *ast.SelectorExpr:
				if x, ok := f.X.(*ast.Ident); ok {
					fn = x.Name + "." + f.Sel.Name
				}
			}
			if !routeFuncs[fn] {
				return true
			}
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				// A wrapper forwarding its parameter (mux.Handle(pattern, …)) is fine; a
				// pattern built by an expression could not be checked.
				if _, ident := call.Args[0].(*ast.Ident); !ident {
					t.Errorf("%s: route pattern is not a string literal; this test cannot check it", fset.Position(call.Args[0].Pos()))
				}
				return true
			}
			pattern, err := strconv.Unquote(lit.Value)
			if err != nil {
				t.Fatal(err)
			}
			n++
			src := pattern + " (" + fset.Position(lit.Pos()).String() + ")"
			method, path, ok := strings.Cut(pattern, " ")
			if !ok {
				method, path = "", pattern
			}
			path = strings.TrimSpace(path)
			if !strings.HasPrefix(path, "/") {
				t.Errorf("%s: route patterns with a host are not supported by this test", src)
				return true
			}
			path = strings.TrimSuffix(path, "{$}")
			if method == "" && strings.HasSuffix(path, "/") {
				// A subtree catch-all such as "/v1/" (the JSON 404 for unknown routes):
				// not an endpoint.
				return true
			}
			path = strings.ReplaceAll(path, "...}", "}")
			routes = append(routes, route{method: method, path: path, src: src})
			return true
		})
		found[filepath.Base(name)] = n
	}
	for _, name := range mustRegister {
		if found[name] == 0 {
			t.Fatalf("%s/%s: found no route registrations; update routeFuncs", routeDir, name)
		}
	}
	return routes
}

// TestOpenAPIRoutes checks that the document and the server's routes agree.
func TestOpenAPIRoutes(t *testing.T) {
	doc := loadDoc(t)
	routes := serverRoutes(t)
	if len(routes) < 20 {
		t.Fatalf("found only %d routes; is the parsing broken?", len(routes))
	}
	// Paths are compared by shape (parameter names blanked): the server may name a
	// parameter differently per method (GET /v1/templates/{name}, DELETE
	// /v1/templates/{ref}), but OpenAPI forbids two templated paths that differ only in
	// parameter names, so the document has one path for both.
	documented := map[string]map[string]bool{} // shape -> METHOD
	docPath := map[string]string{}             // shape -> path in the document
	forEachOperation(doc, func(method, path string, op map[string]any) {
		shape := pathShape(path)
		if prev, ok := docPath[shape]; ok && prev != path {
			t.Errorf("paths %s and %s differ only in parameter names (OpenAPI forbids this)", prev, path)
		}
		docPath[shape] = path
		if documented[shape] == nil {
			documented[shape] = map[string]bool{}
		}
		documented[shape][strings.ToUpper(method)] = true
	})

	// Every route is documented.
	for _, r := range routes {
		ms := documented[pathShape(r.path)]
		switch {
		case r.method == "" && len(ms) == 0:
			t.Errorf("route %s is not documented (path %s)", r.src, r.path)
		case r.method != "" && !ms[r.method]:
			t.Errorf("route %s is not documented (%s %s)", r.src, r.method, r.path)
		}
	}
	// Every documented operation exists.
	for shape, ms := range documented {
		for m := range ms {
			ok := slices.ContainsFunc(routes, func(r route) bool {
				return pathShape(r.path) == shape && (r.method == m || r.method == "" || m == "HEAD" && r.method == "GET")
			})
			if !ok {
				t.Errorf("documented %s %s is not registered by the server", m, docPath[shape])
			}
		}
	}

	// Path templates and path parameters agree.
	paths, _ := doc["paths"].(map[string]any)
	for path, item := range paths {
		item := item.(map[string]any)
		want := pathParams(path)
		for m, op := range item {
			if !httpMethods[m] {
				continue
			}
			got := map[string]bool{}
			for _, ps := range [][]any{asSlice(item["parameters"]), asSlice(op.(map[string]any)["parameters"])} {
				for _, p := range ps {
					p := resolve(t, doc, p)
					if str(p, "in") == "path" {
						got[str(p, "name")] = true
						if p["required"] != true {
							t.Errorf("%s %s: path parameter %q must be required", m, path, str(p, "name"))
						}
					}
				}
			}
			var gotList []string
			for k := range got {
				gotList = append(gotList, k)
			}
			sort.Strings(gotList)
			if !slices.Equal(gotList, want) {
				t.Errorf("%s %s: path parameters %v, want %v", m, path, gotList, want)
			}
		}
	}
}

// pathShape blanks the parameter names of a path template: /a/{x}/b -> /a/{}/b.
func pathShape(path string) string {
	segs := strings.Split(path, "/")
	for i, seg := range segs {
		if strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}") {
			segs[i] = "{}"
		}
	}
	return strings.Join(segs, "/")
}

func pathParams(path string) []string {
	var out []string
	for _, seg := range strings.Split(path, "/") {
		if strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}") {
			out = append(out, seg[1:len(seg)-1])
		}
	}
	sort.Strings(out)
	return out
}

// TestOpenAPIRefs checks that every $ref resolves inside the document.
func TestOpenAPIRefs(t *testing.T) {
	doc := loadDoc(t)
	n := 0
	var walk func(where string, v any)
	walk = func(where string, v any) {
		switch v := v.(type) {
		case map[string]any:
			if ref, ok := v["$ref"]; ok {
				n++
				s, _ := ref.(string)
				if _, err := lookup(doc, s); err != "" {
					t.Errorf("%s: $ref %q: %s", where, s, err)
				}
			}
			for k, c := range v {
				walk(where+"/"+k, c)
			}
		case []any:
			for i, c := range v {
				walk(where+"/"+strconv.Itoa(i), c)
			}
		}
	}
	walk("#", doc)
	if n == 0 {
		t.Fatal("no $ref found")
	}
}

// TestOpenAPISchemas checks that every struct of types.go and snapshots.go has a schema of the same name
// whose properties are the struct's JSON fields, required exactly when the field is
// not omitempty.
func TestOpenAPISchemas(t *testing.T) {
	doc := loadDoc(t)
	schemas, _ := dig(doc, "components", "schemas").(map[string]any)
	var decls []ast.Decl
	for _, file := range []string{"types.go", "snapshots.go"} {
		f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		decls = append(decls, f.Decls...)
	}
	n := 0
	for _, d := range decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.TYPE {
			continue
		}
		for _, s := range g.Specs {
			ts := s.(*ast.TypeSpec)
			st, ok := ts.Type.(*ast.StructType)
			if !ok || !ts.Name.IsExported() {
				continue
			}
			n++
			name := ts.Name.Name
			schema, ok := schemas[name].(map[string]any)
			if !ok {
				t.Errorf("components.schemas lacks %s", name)
				continue
			}
			var props, required []string
			for _, field := range st.Fields.List {
				if field.Tag == nil {
					t.Errorf("%s: field without a json tag", name)
					continue
				}
				tag, _ := strconv.Unquote(field.Tag.Value)
				jname, opts, _ := strings.Cut(reflect.StructTag(tag).Get("json"), ",")
				if jname == "-" || jname == "" {
					continue
				}
				props = append(props, jname)
				if !slices.Contains(strings.Split(opts, ","), "omitempty") {
					required = append(required, jname)
				}
			}
			var gotProps, gotReq []string
			for k := range schema["properties"].(map[string]any) {
				gotProps = append(gotProps, k)
			}
			for _, r := range asSlice(schema["required"]) {
				gotReq = append(gotReq, r.(string))
			}
			for _, l := range [][]string{props, required, gotProps, gotReq} {
				sort.Strings(l)
			}
			if !slices.Equal(props, gotProps) {
				t.Errorf("schema %s: properties %v, want %v (from types.go)", name, gotProps, props)
			}
			if !slices.Equal(required, gotReq) {
				t.Errorf("schema %s: required %v, want %v (fields without omitempty)", name, gotReq, required)
			}
		}
	}
	if n < 10 {
		t.Fatalf("found only %d structs in types.go", n)
	}
}

// TestOpenAPIErrorCodes checks that the Error schema lists exactly fault's codes.
func TestOpenAPIErrorCodes(t *testing.T) {
	doc := loadDoc(t)
	var want []string
	for k := fault.Kind(0); k.String() != ""; k++ {
		want = append(want, k.String())
	}
	var got []string
	for _, c := range asSlice(dig(doc, "components", "schemas", "ErrorBody", "properties", "code", "enum")) {
		got = append(got, c.(string))
	}
	sort.Strings(want)
	sort.Strings(got)
	if len(want) < 5 || !slices.Equal(got, want) {
		t.Errorf("ErrorBody.code enum %v, want %v (internal/fault)", got, want)
	}
}

func forEachOperation(doc map[string]any, fn func(method, path string, op map[string]any)) {
	paths, _ := doc["paths"].(map[string]any)
	for path, item := range paths {
		item, _ := item.(map[string]any)
		for m, op := range item {
			if op, ok := op.(map[string]any); ok && httpMethods[m] {
				fn(m, path, op)
			}
		}
	}
}

// lookup resolves a local JSON pointer reference ("#/a/b").
func lookup(doc map[string]any, ref string) (any, string) {
	rest, ok := strings.CutPrefix(ref, "#/")
	if !ok {
		return nil, "only local references (#/...) are allowed"
	}
	var cur any = doc
	for _, tok := range strings.Split(rest, "/") {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		m, ok := cur.(map[string]any)
		if !ok {
			return nil, "does not resolve"
		}
		if cur, ok = m[tok]; !ok {
			return nil, "does not resolve"
		}
	}
	return cur, ""
}

// resolve follows v's $ref, if any.
func resolve(t *testing.T, doc map[string]any, v any) map[string]any {
	t.Helper()
	m, _ := v.(map[string]any)
	if ref, ok := m["$ref"].(string); ok {
		r, err := lookup(doc, ref)
		if err != "" {
			t.Fatalf("$ref %q: %s", ref, err)
		}
		m, _ = r.(map[string]any)
	}
	return m
}

func dig(v any, keys ...string) any {
	for _, k := range keys {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	return v
}

func asSlice(v any) []any { s, _ := v.([]any); return s }

func str(v any, key string) string {
	m, _ := v.(map[string]any)
	s, _ := m[key].(string)
	return s
}
