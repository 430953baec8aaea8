package template_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template"
	"github.com/spacedev/space/internal/template/templatetest"
)

func requireBuild(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("real debootstrap build skipped in -short mode")
	}
	templatetest.RequireStore(t)
	if _, err := exec.LookPath("debootstrap"); err != nil {
		t.Skip("needs debootstrap")
	}
}

// TestBuildBase runs the real base build (and so fills the test cache) unless the
// cache holds the current recipe already (SPACE_TEST_REBUILD=1 builds anyway: the
// recipe id changes with the package lists and builtinRecipeVersion, which a change to
// the customization bumps), checks the tree, and imports the cached export into a
// second store.
func TestBuildBase(t *testing.T) {
	requireBuild(t)
	ctx := context.Background()
	s := templatetest.Store(t)
	var rel storage.Release
	if templatetest.Cached(t, template.BaseTemplate) && !templatetest.Rebuild() {
		rel = templatetest.Base(t, s)
		t.Logf("base %s from the test cache (SPACE_TEST_REBUILD=1 builds it again), %d MiB", rel.Digest, rel.SizeBytes>>20)
	} else {
		var lines []string
		rel = templatetest.BuildBase(t, s, func(line string) { lines = append(lines, line) })
		t.Logf("base %s, %d MiB, %d progress lines", rel.Digest, rel.SizeBytes>>20, len(lines))
		if len(lines) == 0 || !strings.HasPrefix(lines[0], "I: ") {
			t.Fatalf("progress lines: %q", lines)
		}
	}
	cfg, err := template.ParseConfig(rel.Config)
	if err != nil {
		t.Fatal(err)
	}
	if rel.Name != "base" || cfg.User != "user" || cfg.Workdir != "/home/user" || rel.SizeBytes <= 0 {
		t.Fatalf("release = %+v", rel)
	}
	root, err := s.ReleaseRoot(rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if ro, err := s.IsReadOnly(root); err != nil || !ro {
		t.Fatalf("release read-only = %v, %v", ro, err)
	}
	for _, p := range []string{"usr/bin/bash", "usr/bin/python3", "usr/bin/python", "usr/bin/pip", "usr/bin/ps", "usr/sbin/ip",
		"usr/bin/git", "usr/bin/curl", "usr/bin/sudo", "usr/bin/node", "usr/bin/npm", "usr/bin/gcc", "usr/bin/make",
		"etc/ssl/certs/ca-certificates.crt", ".space", "run/space", template.ConfigFile} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Errorf("missing %s: %v", p, err)
		}
	}
	if sudoers, err := os.ReadFile(filepath.Join(root, "etc/sudoers.d/user")); err != nil || string(sudoers) != "user ALL=(ALL:ALL) NOPASSWD: ALL\n" {
		t.Errorf("sudoers: %q %v", sudoers, err)
	}
	if cfg, err := template.ReadConfigFile(root); err != nil || cfg.User != "user" || cfg.Workdir != "/home/user" {
		t.Errorf("recorded config: %+v %v", cfg, err)
	}
	for _, p := range []string{"var/cache/apt/archives/partial", "usr/sbin/policy-rc.d"} {
		if matches, _ := filepath.Glob(filepath.Join(root, p, "*")); len(matches) > 0 {
			t.Errorf("build leftovers in %s: %v", p, matches)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "usr/sbin/policy-rc.d")); err == nil {
		t.Error("policy-rc.d left in the tree")
	}
	fi, err := os.Stat(filepath.Join(root, "home/user"))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); !fi.IsDir() || st.Uid != 1000 || st.Gid != 1000 {
		t.Fatalf("/home/user: dir=%v uid=%d gid=%d", fi.IsDir(), st.Uid, st.Gid)
	}
	passwd, err := os.ReadFile(filepath.Join(root, "etc/passwd"))
	if err != nil || !strings.Contains(string(passwd), "\nuser:x:1000:1000::/home/user:/bin/bash\n") {
		t.Fatalf("etc/passwd lacks user: %v\n%s", err, passwd)
	}

	// The tree runs: python3 as user in a sandbox snapshot of the release.
	sroot, err := s.CreateSandboxRoot(ctx, "pycheck", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, "chroot", "--userspec=1000:1000", sroot, "/usr/bin/python3", "-c",
		"import os, pwd, ssl; print(os.getuid(), pwd.getpwuid(os.getuid()).pw_dir)").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "1000 /home/user" {
		t.Fatalf("python3 in sandbox root: %v: %s", err, out)
	}
	// A login shell (what E2B's SDKs run commands in) starts no program, as root or
	// user, and gets Debian's PATH; dash, which has no EUID, still asks id.
	for _, p := range []string{"usr/local/bin/id", "usr/local/sbin/mesg"} {
		marker := "/tmp/ran-" + filepath.Base(p)
		script := "#!/bin/sh\necho >> " + marker + "\nexec /usr/bin/" + filepath.Base(p) + " \"$@\"\n"
		if err := os.WriteFile(filepath.Join(sroot, p), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct{ user, shell, path, ran string }{
		{"0:0", "/bin/bash", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ""},
		{"1000:1000", "/bin/bash", "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games", ""},
		{"1000:1000", "/bin/sh", "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games", "id"},
	} {
		_ = os.Remove(filepath.Join(sroot, "tmp/ran-id"))
		_ = os.Remove(filepath.Join(sroot, "tmp/ran-mesg"))
		home := "/root"
		if c.user != "0:0" {
			home = "/home/user"
		}
		cmd := exec.CommandContext(ctx, "chroot", "--userspec="+c.user, sroot, c.shell, "-l", "-c", `echo "$PATH"`)
		cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + home}
		out, err := cmd.CombinedOutput()
		var ran []string
		for _, prog := range []string{"id", "mesg"} {
			if _, err := os.Stat(filepath.Join(sroot, "tmp/ran-"+prog)); err == nil {
				ran = append(ran, prog)
			}
		}
		if err != nil || strings.TrimSpace(string(out)) != c.path || strings.Join(ran, ",") != c.ran {
			t.Errorf("%s -l as %s: %v: PATH %q (want %q), programs run %q (want %q)", c.shell, c.user, err, out, c.path, ran, c.ran)
		}
	}
	if err := s.DeleteSandbox(ctx, "pycheck"); err != nil {
		t.Fatal(err)
	}

	// The cache this build wrote imports with the same digest.
	s2 := templatetest.Store(t)
	if got := templatetest.Base(t, s2); got.Digest != rel.Digest || !got.CreatedAt.Equal(rel.CreatedAt) {
		t.Fatalf("cached base %+v, built %+v", got, rel)
	}
}

// TestBuildBaseCancel cancels a build while debootstrap installs packages in the target
// (proc mounted there) and checks that nothing is left: no build directory, no mounts,
// no processes.
func TestBuildBaseCancel(t *testing.T) {
	requireBuild(t)
	s := templatetest.Store(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := &template.Builder{Store: s, CacheDir: filepath.Join(templatetest.CacheDir(t), "debootstrap")}
	cancelled := false
	_, err := b.BuildBase(ctx, func(line string) {
		if strings.Contains(line, "Installing core packages") {
			cancelled = true
			cancel()
		}
	})
	if !cancelled {
		t.Fatalf("build ended before the cancel point: %v", err)
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("BuildBase = %v, want context.Canceled", err)
	}
	entries, err := os.ReadDir(filepath.Join(s.Root(), "tmp"))
	if err != nil || len(entries) != 0 {
		t.Fatalf("tmp after cancel: %v %v", entries, err)
	}
	if rels, err := s.ListReleases(); err != nil || len(rels) != 0 {
		t.Fatalf("releases after cancel: %v %v", rels, err)
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil || strings.Contains(string(mounts), s.Root()+"/") {
		t.Fatalf("mounts left under the store: %v\n%s", err, mounts)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/root")
	for _, p := range procs {
		if target, err := os.Readlink(p); err == nil && strings.HasPrefix(target, s.Root()) {
			t.Errorf("process %s still runs in %s", p, target)
		}
	}
}

// TestCodeInterpreterTemplate checks the code-interpreter-v1 release (built from a
// snapshot of base, or taken from the test cache): the kernel and the data packages
// import as the sandbox user, the server is in place, and the recorded config starts it.
func TestCodeInterpreterTemplate(t *testing.T) {
	requireBuild(t)
	ctx := context.Background()
	s := templatetest.Store(t)
	rel := templatetest.Builtin(t, s, template.CodeInterpreterTemplate)
	t.Logf("%s %s, %d MiB", template.CodeInterpreterTemplate, rel.Digest, rel.SizeBytes>>20)
	cfg, err := template.ParseConfig(rel.Config)
	if err != nil {
		t.Fatal(err)
	}
	if rel.Name != template.CodeInterpreterTemplate || cfg.User != "user" || len(cfg.Start) == 0 || cfg.Ready == nil {
		t.Fatalf("release %+v, config %+v", rel, cfg)
	}
	sroot, err := s.CreateSandboxRoot(ctx, "cicheck", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.DeleteSandbox(ctx, "cicheck")
	if _, err := os.Stat(filepath.Join(sroot, strings.TrimPrefix(cfg.Start[len(cfg.Start)-1], "/"))); err != nil {
		t.Fatalf("the server the config starts: %v", err)
	}
	for _, p := range []string{"usr/bin/git", "usr/bin/node", "usr/bin/sudo", "etc/sudoers.d/user"} {
		if _, err := os.Stat(filepath.Join(sroot, p)); err != nil {
			t.Errorf("missing %s (from base): %v", p, err)
		}
	}
	if m, _ := filepath.Glob(filepath.Join(sroot, "var/lib/apt/lists/*_*")); len(m) > 0 {
		t.Errorf("package indexes left in the tree: %d", len(m))
	}
	out, err := exec.CommandContext(ctx, "chroot", "--userspec=1000:1000", sroot, "/usr/bin/env", "HOME=/home/user", "MPLBACKEND=Agg",
		"/usr/bin/python3", "-c", "import ipykernel, jupyter_client, numpy, pandas, matplotlib.pyplot; print('ok')").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "ok" {
		t.Fatalf("imports as user: %v: %s", err, out)
	}
}
