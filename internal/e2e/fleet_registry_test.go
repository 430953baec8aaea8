package e2e

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

// TestFleetTemplateRegistry runs a fleet of two node processes sharing a registry: the
// node whose store holds base registers and pushes it on first use; the other, with an
// empty store, starts base:latest without building it — it pulls the same release from
// the registry — and is then recorded as holding it. A release the database says is in
// the registry but is not fails its create with the registry named, and is marked for
// its holders to push again.
func TestFleetTemplateRegistry(t *testing.T) {
	requireHost(t)
	db := testenv.Postgres(t)
	reg := testenv.StartRegistry(t)
	registry := []string{"--registry", reg.Addr + "/space"}
	apiSrv := start(t, options{DBURL: db, NoBase: true, Args: append([]string{"--roles", "api,controller"}, registry...)})
	n1 := start(t, options{DBURL: db, Args: append([]string{"--roles", "node", "--node-name", "n1"}, registry...)})
	n2 := start(t, options{DBURL: db, NoBase: true, Args: append([]string{"--roles", "node", "--node-name", "n2"}, registry...)})
	c := ctx(t, 4*time.Minute)
	st, err := store.Open(c, store.Config{URL: db, Logger: discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	waitFor(t, time.Minute, "both nodes to register", func() bool {
		nodes, err := apiSrv.C.ListNodes(c)
		alive := 0
		for _, n := range nodes {
			if n.State == "alive" {
				alive++
			}
		}
		return err == nil && alive == 2
	})
	ids := map[string]string{} // name → id
	nodes, _ := apiSrv.C.ListNodes(c)
	for _, n := range nodes {
		ids[n.Name] = n.ID
	}
	onNode := func(sb *api.Sandbox, name string) bool { return sb.Node == name || sb.Node == ids[name] }
	cordon := func(name string, on bool) {
		t.Helper()
		if _, err := st.SetCordoned(c, name, on); err != nil {
			t.Fatal(err)
		}
	}

	// n1 holds base in its store: it registers it and pushes it before it is usable.
	cordon("n2", true)
	began := time.Now()
	sb1 := apiSrv.create(t, api.CreateSandboxRequest{})
	t.Logf("first create on n1 (register and push base): %s", time.Since(began).Round(time.Millisecond))
	if !onNode(sb1, "n1") || sb1.TemplateDigest == "" {
		t.Fatalf("first sandbox on %q (want n1), digest %q", sb1.Node, sb1.TemplateDigest)
	}
	rel, err := st.GetRelease(c, sb1.TemplateDigest)
	if err != nil || rel.Registry == "" {
		t.Fatalf("base's release is not recorded as in the registry: %+v %v", rel, err)
	}

	// n2 has no base: it pulls n1's release from the registry instead of building.
	cordon("n2", false)
	cordon("n1", true)
	began = time.Now()
	sb2 := apiSrv.create(t, api.CreateSandboxRequest{})
	t.Logf("first create on n2 (pull base): %s", time.Since(began).Round(time.Millisecond))
	if !onNode(sb2, "n2") {
		t.Fatalf("second sandbox on %q, want n2", sb2.Node)
	}
	if sb2.TemplateDigest != sb1.TemplateDigest {
		t.Fatalf("n2 started %s, not n1's release %s", sb2.TemplateDigest, sb1.TemplateDigest)
	}
	if out, _, code := apiSrv.exec(t, sb2.ID, "python3", "-c", "print(6*7)"); code != 0 || out != "42\n" {
		t.Fatalf("exec on the pulled template: %d %q", code, out)
	}
	var builds int
	sqlDB := st.DB()
	defer sqlDB.Close()
	if err := sqlDB.QueryRowContext(c, `SELECT count(*) FROM operations WHERE kind=$1`, api.OpTemplateBuild).Scan(&builds); err != nil {
		t.Fatal(err)
	}
	if builds != 0 {
		t.Fatalf("%d template builds ran; base was to be pulled, not built", builds)
	}
	if !strings.Contains(n2.Log(), "pulled template release") {
		t.Fatalf("n2 did not log a pull:\n%s", n2.Log())
	}
	held, err := st.NodeReleases(c)
	if err != nil || !held[ids["n2"]][sb1.TemplateDigest] {
		t.Fatalf("n2 is not recorded as holding base after the pull: %v %v", held, err)
	}
	if d, _ := st.ResolveTag(c, "base", "latest"); d != sb1.TemplateDigest {
		t.Fatalf("base:latest moved to %s", d)
	}

	// A release recorded as in the registry that the registry lacks: the create fails
	// naming the registry, and the release goes back to its holders to push.
	lost := "sha256:" + strings.Repeat("ab", 32)
	if err := st.PutRelease(c, &store.Release{Digest: lost, Name: "base", Registry: "sha256:" + strings.Repeat("cd", 32)}, "", ""); err != nil {
		t.Fatal(err)
	}
	bad, err := apiSrv.C.CreateAndWait(c, api.CreateSandboxRequest{Template: "base@" + lost})
	if err == nil && bad.State != api.StateFailed {
		t.Fatalf("a create from a release missing from the registry: %+v", bad)
	}
	msg := ""
	if err != nil {
		msg = err.Error()
	} else {
		msg = bad.Error
	}
	if !strings.Contains(msg, reg.Addr) || !strings.Contains(msg, "missing from registry") {
		t.Fatalf("the failure does not name the registry: %q", msg)
	}
	if r, err := st.GetRelease(c, lost); err != nil || r.Registry != "" {
		t.Fatalf("the lost release is still recorded as in the registry: %+v %v", r, err)
	}
	_ = n1
}

// TestBenchTemplatePullFigures prints `space bench --only template-pull` for
// docs/benchmarks.md (a server with a registry; the pull goes into an empty store); it
// runs only when SPACE_BENCH_RUNS is set:
// SPACE_BENCH_RUNS=5 go test -run TestBenchTemplatePullFigures -v ./internal/e2e/
func TestBenchTemplatePullFigures(t *testing.T) {
	runs := os.Getenv("SPACE_BENCH_RUNS")
	if runs == "" {
		t.Skip("set SPACE_BENCH_RUNS to measure")
	}
	reg := testenv.StartRegistry(t)
	s := start(t, options{Args: []string{"--registry", reg.Addr + "/space"}})
	out, stderr, code := s.cli(t, "bench", "--runs", runs, "--only", "template-pull", "--registry", reg.Addr+"/space")
	if code != 0 {
		t.Fatalf("space bench: exit %d\n%s\n%s", code, stderr, s.Log())
	}
	if !strings.Contains(out, "template-pull") {
		t.Fatalf("no template-pull row:\n%s\n%s", out, stderr)
	}
	t.Logf("\n%s", out)
}
