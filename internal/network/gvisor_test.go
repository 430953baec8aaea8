package network_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/runtime/gvisor"
	"github.com/spacedev/space/internal/testenv"
)

// TestGVisorInSandboxNetns runs a real gVisor sandbox (runsc, netstack: --network=sandbox)
// in a sandbox's namespace: busybox wget resolves an allowed name through the sandbox's
// resolver and fetches from the fake internet; a non-allowed address and the metadata
// service stay unreachable. It records what the gVisor runtime needs (docs/networking.md).
// SPACE_RUNSC names the runsc binary (default: runsc on PATH).
func TestGVisorInSandboxNetns(t *testing.T) {
	testenv.RequireRoot(t)
	runsc := os.Getenv("SPACE_RUNSC")
	if runsc == "" {
		runsc = testenv.RequireBinary(t, "runsc", "Debian package runsc, or set SPACE_RUNSC")
	}
	goBin := testenv.RequireBinary(t, "go", "the Go toolchain builds the probe")
	e := newEnv(t)
	s := e.sandbox("gvisor1", &api.Network{Egress: true, AllowOut: []string{"api.example.test"}, DenyOut: denyAll})

	dir := t.TempDir()
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{"bin", "etc", "proc", "tmp"} {
		if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	build := exec.Command(goBin, "build", "-o", filepath.Join(rootfs, "bin/netprobe"), "./testdata/netprobe")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build netprobe: %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "etc/resolv.conf"), []byte(s.att.ResolvConf()), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"/bin/netprobe", "http://api.example.test/from-gvisor", "http://" + web2 + "/not-allowed",
		"http://169.254.169.254/latest", "http://other.test/not-allowed-name"}
	spec := specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{Args: args, Cwd: "/",
			Env: []string{"PATH=/bin"}},
		Root:     &specs.Root{Path: rootfs},
		Hostname: "gvisor1",
		Mounts:   []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
			{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			{Type: specs.MountNamespace},
			// The sandbox's namespace: runsc's netstack takes over its eth0.
			{Type: specs.NetworkNamespace, Path: s.att.Netns},
		}},
	}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	root := filepath.Join(dir, "runsc-root")
	run := func(platform string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, runsc, "--root="+root, "--network=sandbox", "--platform="+platform,
			"run", "--bundle", dir, "gvisor1-net")
		out, err := cmd.CombinedOutput()
		_ = exec.Command(runsc, "--root="+root, "delete", "-force", "gvisor1-net").Run()
		// runsc leaves a pinned namespace of its own in its root directory.
		_ = gvisor.UnpinNullNetNS(root)
		return out, err
	}
	out, err := run("systrap")
	if strings.Contains(string(out), "unknown platform") {
		out, err = run("ptrace") // runsc before 2023
	}
	t.Logf("runsc output:\n%s", out)
	if err != nil && strings.Contains(string(out), "cannot run with network enabled in root network namespace") {
		// Debian bookworm's runsc (2022-12) refuses a prepared namespace.
		t.Skip("skipping: this runsc is too old for --network=sandbox in a prepared namespace; set SPACE_RUNSC to a 2023 or later release")
	}
	if err != nil {
		t.Fatalf("runsc run: %v", err)
	}
	got := string(out)
	for _, want := range []string{"ok http://api.example.test/from-gvisor 200", "fail http://" + web2 + "/not-allowed",
		"fail http://169.254.169.254/latest", "fail http://other.test/not-allowed-name"} {
		if !strings.Contains(got, want) {
			t.Fatalf("runsc output lacks %q", want)
		}
	}
	if r := lastRequest(t, e, "/from-gvisor"); r.Host != "api.example.test" {
		t.Fatalf("request %+v", r)
	}
	if e.fn.Hits("http "+web2+":80") != 0 || e.fn.Hits("http 169.254.169.254:80") != 0 {
		t.Fatal("a denied destination was reached from gVisor")
	}
}
