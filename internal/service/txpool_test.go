package service_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoPoolInTransaction reads the service's and the controller's code: a transaction
// (a func(*store.Tx) closure) must not reach the connection pool (the receiver's st,
// other than st.InTx), directly or through the package's own functions and methods it
// calls. A transaction that waits for a second connection while others queue, each
// holding one, on a lock it holds stops the API for good: a verb once checked its
// sandbox's node that way (TestOneConnectionServesEveryVerb in internal/server runs it
// on a single connection). Calls are resolved by name: the receiver's methods (s.m,
// c.m) and the package's functions.
func TestNoPoolInTransaction(t *testing.T) {
	for _, pkg := range []struct{ dir, recv string }{{".", "s"}, {"../controller", "c"}} {
		fset := token.NewFileSet()
		funcs := map[string]*ast.FuncDecl{} // methods of the receiver's type and package functions, by name
		entries, err := os.ReadDir(pkg.dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, filepath.Join(pkg.dir, e.Name()), nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range f.Decls {
				if fd, ok := d.(*ast.FuncDecl); ok && fd.Body != nil {
					if fd.Recv == nil || len(fd.Recv.List[0].Names) == 1 && fd.Recv.List[0].Names[0].Name == pkg.recv {
						funcs[fd.Name.Name] = fd
					}
				}
			}
		}
		// pool lists where n reaches the pool, following calls (path names them).
		visiting := map[string]bool{}
		var pool func(n ast.Node, path string) []string
		pool = func(n ast.Node, path string) []string {
			var out []string
			ast.Inspect(n, func(x ast.Node) bool {
				switch x := x.(type) {
				case *ast.FuncLit:
					return !txFunc(x) // a transaction of its own is checked on its own
				case *ast.SelectorExpr:
					if id, ok := x.X.(*ast.Ident); ok && id.Name == pkg.recv && x.Sel.Name == "st" {
						out = append(out, path+": "+fset.Position(x.Pos()).String())
					}
					if inner, ok := x.X.(*ast.SelectorExpr); ok && x.Sel.Name == "InTx" {
						if id, ok := inner.X.(*ast.Ident); ok && id.Name == pkg.recv && inner.Sel.Name == "st" {
							return false // s.st.InTx: a nested transaction is its own finding below
						}
					}
				case *ast.CallExpr:
					var name string
					switch fn := x.Fun.(type) {
					case *ast.Ident:
						name = fn.Name
					case *ast.SelectorExpr:
						if id, ok := fn.X.(*ast.Ident); ok && id.Name == pkg.recv {
							name = fn.Sel.Name
						}
					}
					if fd := funcs[name]; fd != nil && !visiting[name] {
						visiting[name] = true
						out = append(out, pool(fd.Body, path+" → "+name)...)
						visiting[name] = false
					}
				}
				return true
			})
			return out
		}
		found := 0
		for name, fd := range funcs {
			ast.Inspect(fd.Body, func(x ast.Node) bool {
				if fl, ok := x.(*ast.FuncLit); ok && txFunc(fl) {
					found++
					for _, where := range pool(fl.Body, name+"'s transaction") {
						t.Errorf("%s reaches the pool (%s.st)", where, pkg.recv)
					}
				}
				return true
			})
		}
		if found == 0 {
			t.Fatalf("%s: no transaction found; the check reads nothing", pkg.dir)
		}
	}
}

// txFunc reports whether fl takes a *store.Tx.
func txFunc(fl *ast.FuncLit) bool {
	for _, p := range fl.Type.Params.List {
		if st, ok := p.Type.(*ast.StarExpr); ok {
			if se, ok := st.X.(*ast.SelectorExpr); ok && se.Sel.Name == "Tx" {
				if id, ok := se.X.(*ast.Ident); ok && id.Name == "store" {
					return true
				}
			}
		}
	}
	return false
}
