package e2e

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template"
	"github.com/spacedev/space/internal/template/templatetest"
)

// TestFirstBuild starts a server with an empty store: the first create builds the base
// template (real debootstrap; the package cache is shared with other tests), its
// operation says it waits for the build, the build's log is readable, and a second
// create made meanwhile waits for the same build. The release it built fills the test
// cache the other tests take base from; so on a machine whose cache holds base's
// current recipe already, the test is skipped (SPACE_TEST_REBUILD=1 runs it anyway).
// It is the package's first test (its file sorts first) so that a fresh machine builds
// base once, here.
func TestFirstBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the base template with debootstrap (minutes)")
	}
	requireHost(t)
	if templatetest.Cached(t, template.BaseTemplate) && !templatetest.Rebuild() {
		t.Skip("the test cache holds base's current recipe: the first-use build ran on this machine already (SPACE_TEST_REBUILD=1 runs it again)")
	}
	s := startWith(t, options{NoBase: true}, func(dataDir string) {
		// Share debootstrap's package cache with the other tests' builds.
		cache := filepath.Join(templatetest.CacheDir(t), "debootstrap")
		if err := os.MkdirAll(filepath.Join(dataDir, "cache"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(cache, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(cache, filepath.Join(dataDir, "cache", "debootstrap")); err != nil {
			t.Fatal(err)
		}
	})
	first, err := s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	var buildOp string
	waitFor(t, time.Minute, "the create operation to say it waits for the build", func() bool {
		op, err := s.C.GetOperation(ctx(t, time.Minute), first.Operation.ID)
		if err != nil {
			t.Fatal(err)
		}
		if i := strings.Index(op.Message, "operation op_"); strings.Contains(op.Message, "waiting for template base:latest") && i >= 0 {
			buildOp = strings.TrimSuffix(strings.Fields(op.Message[i+len("operation "):])[0], ")")
			return true
		}
		return false
	})
	second, err := s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range []*api.Sandbox{first, second} {
		op, err := s.C.WaitOperation(ctx(t, 20*time.Minute), sb.Operation.ID)
		if err != nil || op.State != api.OpSucceeded {
			t.Fatalf("create %s: %+v %v", sb.ID, op, err)
		}
	}
	bop, err := s.C.GetOperation(ctx(t, time.Minute), buildOp)
	if err != nil || bop.Kind != api.OpTemplateBuild || bop.State != api.OpSucceeded {
		t.Fatalf("build operation %s: %+v %v", buildOp, bop, err)
	}
	req, _ := http.NewRequest("GET", s.URL+"/v1/operations/"+buildOp+"/log", nil)
	req.Header.Set("Authorization", "Bearer "+s.Key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var log struct {
		Lines []struct{ Line string } `json:"lines"`
	}
	json.NewDecoder(resp.Body).Decode(&log)
	resp.Body.Close()
	if len(log.Lines) < 3 || !strings.Contains(log.Lines[len(log.Lines)-1].Line+log.Lines[len(log.Lines)-2].Line+log.Lines[len(log.Lines)-3].Line, "I: ") {
		t.Fatalf("build log: %+v", log.Lines)
	}
	templates, err := s.C.ListTemplates(ctx(t, time.Minute))
	if err != nil || len(templates) != 1 || templates[0].Name != "base" || templates[0].Tags[0] != "latest" {
		t.Fatalf("templates: %+v %v", templates, err)
	}
	a, _ := s.C.GetSandbox(ctx(t, time.Minute), first.ID)
	b, _ := s.C.GetSandbox(ctx(t, time.Minute), second.ID)
	if a.TemplateDigest != templates[0].Digest || b.TemplateDigest != templates[0].Digest {
		t.Fatalf("digests %s %s, release %s", a.TemplateDigest, b.TemplateDigest, templates[0].Digest)
	}
	out, _, code := s.exec(t, first.ID, "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("exec: %d %q", code, out)
	}
	// The other tests take this build from the test cache.
	st, err := storage.Open(ctx(t, time.Minute), storage.Config{DataDir: s.DataDir})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	templatetest.Keep(t, st, template.BaseTemplate, templates[0].Digest)
}
