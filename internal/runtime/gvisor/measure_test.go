package gvisor

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// TestMeasureRunsc times bare runsc, old against new, side by side: `runsc run` of
// `true`, of a dd making 200,000 system calls, and checkpoint and restore of a sleeping
// container, each on a busybox root
// filesystem with no network. It only runs with SPACE_MEASURE_RUNSC=1 (it takes about
// a minute); SPACE_MEASURE_RUNS sets the runs per figure (default 10).
//
//	SPACE_MEASURE_RUNSC=1 go test -run TestMeasureRunsc -v ./internal/runtime/gvisor/
func TestMeasureRunsc(t *testing.T) {
	if os.Getenv("SPACE_MEASURE_RUNSC") == "" {
		t.Skip("set SPACE_MEASURE_RUNSC=1 to measure")
	}
	needRunsc(t)
	runs := 10
	if n := os.Getenv("SPACE_MEASURE_RUNS"); n != "" {
		fmt.Sscan(n, &runs)
	}
	rootfs := busyboxRootfs(t)
	type config struct {
		name, platform        string
		m                     measurer
		run, ckpt, restr, sys []time.Duration
	}
	var configs []*config
	for _, c := range []struct{ name, runsc, platform string }{
		{"debian 20221219", "/usr/bin/runsc", "ptrace"},
		{"pinned", DefaultRunscPath, "ptrace"},
		{"pinned", DefaultRunscPath, "systrap"},
	} {
		if _, err := os.Stat(c.runsc); err != nil {
			t.Logf("%s: %v", c.name, err)
			continue
		}
		m := measurer{t: t, runsc: c.runsc, platform: c.platform, root: t.TempDir(), rootfs: rootfs}
		t.Cleanup(func() { unmountNullNetNS(t, m.root) })
		configs = append(configs, &config{name: c.name, platform: c.platform, m: m})
	}
	// Round-robin, so that the load of a shared machine falls on every configuration
	// alike.
	for i := range runs {
		for _, c := range configs {
			c.run = append(c.run, c.m.run(fmt.Sprintf("r%d", i), "/bin/true"))
			c.sys = append(c.sys, c.m.run(fmt.Sprintf("s%d", i), "/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=100000"))
			ck, r := c.m.checkpointRestore(fmt.Sprintf("c%d", i))
			c.ckpt, c.restr = append(c.ckpt, ck), append(c.restr, r)
		}
	}
	for _, c := range configs {
		t.Logf("%-16s %-8s run true: %v   run dd 200k syscalls: %v   checkpoint: %v   restore: %v   (median of %d; min %v, %v, %v, %v)",
			c.name, c.platform, median(c.run), median(c.sys), median(c.ckpt), median(c.restr), runs,
			slices.Min(c.run).Round(time.Millisecond), slices.Min(c.sys).Round(time.Millisecond),
			slices.Min(c.ckpt).Round(time.Millisecond), slices.Min(c.restr).Round(time.Millisecond))
	}
}

type measurer struct {
	t                     *testing.T
	runsc, platform, root string
	rootfs                string
}

func (m measurer) cmd(args ...string) *exec.Cmd {
	return exec.Command(m.runsc, append([]string{"--root=" + m.root, "--platform=" + m.platform, "--network=none", "--overlay2=none"}, args...)...)
}

// must runs runsc with its output in a file: a detached sandbox inherits runsc's stdio,
// and a pipe would stay open as long as the sandbox runs.
func (m measurer) must(args ...string) {
	m.t.Helper()
	out, err := os.CreateTemp(m.t.TempDir(), "out")
	if err != nil {
		m.t.Fatal(err)
	}
	defer out.Close()
	cmd := m.cmd(args...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		b, _ := os.ReadFile(out.Name())
		m.t.Fatalf("runsc %s: %v\n%s", strings.Join(args, " "), err, b)
	}
}

// bundle writes a bundle that runs argv.
func (m measurer) bundle(argv ...string) string {
	m.t.Helper()
	dir := m.t.TempDir()
	s := &specs.Spec{
		Version: ociVersion,
		Process: &specs.Process{Args: argv, Cwd: "/", Env: []string{"PATH=/bin"}},
		Root:    &specs.Root{Path: m.rootfs, Readonly: true},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs"},
		},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace}, {Type: specs.MountNamespace}}},
	}
	data, err := json.Marshal(s)
	if err != nil {
		m.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, configFile), data, 0o600); err != nil {
		m.t.Fatal(err)
	}
	return dir
}

// run times `runsc run` of argv (to its exit).
func (m measurer) run(id string, argv ...string) time.Duration {
	m.t.Helper()
	b := m.bundle(argv...)
	start := time.Now()
	m.must("run", "-bundle", b, id)
	d := time.Since(start)
	m.must("delete", "-force", id)
	return d
}

// checkpointRestore times `runsc checkpoint` of a sleeping container and `runsc restore
// -detach` of the image (until runsc returns: the sandbox runs).
func (m measurer) checkpointRestore(id string) (time.Duration, time.Duration) {
	m.t.Helper()
	b := m.bundle("/bin/sleep", "1000")
	m.must("run", "-detach", "-bundle", b, id)
	img := m.t.TempDir()
	start := time.Now()
	m.must("checkpoint", "-image-path", img, id)
	ckpt := time.Since(start)
	m.must("delete", "-force", id)
	start = time.Now()
	m.must("restore", "-image-path", img, "-detach", "-bundle", b, id+"r")
	rest := time.Since(start)
	m.must("kill", id+"r", "KILL")
	m.must("delete", "-force", id+"r")
	return ckpt, rest
}

func median(xs []time.Duration) time.Duration {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2].Round(time.Millisecond)
}

// busyboxRootfs is a root filesystem holding busybox (Debian's busybox-static) as true
// and sleep.
func busyboxRootfs(t *testing.T) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("busybox not installed (apt-get install busybox-static)")
	}
	dir := t.TempDir()
	for _, d := range []string{"bin", "proc", "tmp", "dev"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"true", "sleep", "sh", "dd"} {
		if err := os.Symlink("busybox", filepath.Join(dir, "bin", name)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
