// Package template builds template releases into the storage store: the builtin
// templates "base" and "code-interpreter-v1" (builtin.go: Debian bookworm from
// debootstrap with a user "user", uid 1000, home /home/user), and releases described
// by a build spec (spec.go): a root filesystem from
// a Debian suite, an OCI image (registry, docker-archive tarball or OCI layout), a
// directory or an existing release, then build steps run in a build sandbox, and a
// runtime config. It also owns the operator's allowlist of template sources
// (sources.go) and the confined extraction of image layers (extract.go).
//
// A build runs in a tmp/ subvolume of the store (storage.ReleaseBuild) and is published
// by storage with its content digest; a failed or cancelled build leaves nothing behind.
// Host commands (debootstrap) run as PID 1 of a fresh PID namespace, inside a private
// mount namespace: killing that one process makes the kernel kill every process
// debootstrap started and drop every mount it made (proc, sys in the target), so
// cancellation cannot leave processes or mounts pinning the build directory. Archive
// entries are written through an os.Root, so no entry can land outside the root
// filesystem; build steps run inside a sandbox (the node starts it) and files are
// copied in through its agent, so guest paths never resolve on the host.
package template

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spacedev/space/internal/storage"
)

// The builtin templates' common recipe (builtin.go has the rest).
const (
	baseSuite   = "bookworm"
	baseVariant = "minbase"
	baseUser    = "user"
	baseUID     = "1000"
	baseHome    = "/home/user"
)

// Builder builds template releases into Store.
type Builder struct {
	// Store receives the releases.
	Store *storage.Store
	// Logger receives build output at debug level (default: discarded).
	Logger *slog.Logger
	// Mirror is the Debian mirror URL for debootstrap; empty uses debootstrap's default.
	Mirror string
	// CacheDir keeps downloaded packages between builds (debootstrap --cache-dir);
	// empty disables the cache. Created if missing.
	CacheDir string
	// Sources is the operator's allowlist for image, archive, dir and copy sources.
	Sources Sources
}

// AllowedSources returns the allowlist this builder enforces.
func (b *Builder) AllowedSources() Sources { return b.Sources }

func (b *Builder) logger() *slog.Logger {
	if b.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return b.Logger
}

// debootstrap installs a Debian suite (variant minbase, plus packages) into rootfs, an
// empty directory. progress, if not nil, receives debootstrap's status lines. Needs
// root.
func (b *Builder) debootstrap(ctx context.Context, rootfs, suite string, packages []string, progress func(string)) error {
	if os.Geteuid() != 0 {
		return errors.New("template: building from a Debian suite needs root")
	}
	debootstrap, err := exec.LookPath("debootstrap")
	if err != nil {
		return errors.New("template: debootstrap not found: install the Debian package debootstrap")
	}
	args := []string{"--variant=" + baseVariant}
	if len(packages) > 0 {
		args = append(args, "--include="+strings.Join(packages, ","))
	}
	if b.CacheDir != "" {
		cache, err := filepath.Abs(b.CacheDir)
		if err != nil {
			return fmt.Errorf("template: %w", err)
		}
		if err := os.MkdirAll(cache, 0o755); err != nil {
			return fmt.Errorf("template: %w", err)
		}
		args = append(args, "--cache-dir="+cache)
	}
	args = append(args, suite, rootfs)
	if b.Mirror != "" {
		args = append(args, b.Mirror)
	}
	if err := b.runInTarget(ctx, progress, rootfs, debootstrap, args...); err != nil {
		return fmt.Errorf("template: debootstrap: %w", err)
	}
	return nil
}

// customizeBase adds the user (with passwordless sudo, as on E2B), the runtime mount
// points, and removes host-derived and cache files debootstrap leaves behind. It
// returns the path of chroot(8) for further steps.
func (b *Builder) customizeBase(ctx context.Context, rootfs string) (string, error) {
	chroot, err := exec.LookPath("chroot")
	if err != nil {
		return "", fmt.Errorf("chroot not found: %w", err)
	}
	if err := b.runInTarget(ctx, nil, rootfs, chroot, rootfs, "useradd",
		"--uid", baseUID, "--user-group", "--create-home", "--home-dir", baseHome,
		"--shell", "/bin/bash", baseUser); err != nil {
		return "", fmt.Errorf("add user: %w", err)
	}
	for _, d := range []string{".space", "run/space"} {
		if err := os.MkdirAll(filepath.Join(rootfs, d), 0o755); err != nil {
			return "", err
		}
	}
	if _, err := os.Stat(filepath.Join(rootfs, "etc/sudoers.d")); err == nil {
		sudoers := filepath.Join(rootfs, "etc/sudoers.d", baseUser)
		if err := os.WriteFile(sudoers, []byte(baseUser+" ALL=(ALL:ALL) NOPASSWD: ALL\n"), 0o440); err != nil {
			return "", err
		}
		if err := os.Chmod(sudoers, 0o440); err != nil {
			return "", err
		}
	}
	if err := quickLogin(rootfs); err != nil {
		return "", fmt.Errorf("login shell: %w", err)
	}
	// debootstrap copies the build host's resolv.conf and hostname; a sandbox has no
	// network by default and the runtime provides both when it has.
	if err := os.WriteFile(filepath.Join(rootfs, "etc/resolv.conf"), nil, 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(rootfs, "etc/hostname"), []byte("sandbox\n"), 0o644); err != nil {
		return "", err
	}
	// Package indexes and apt's binary caches: large, stale soon, rebuilt by apt-get update.
	for _, pattern := range []string{"var/lib/apt/lists/*_*", "var/cache/apt/*.bin"} {
		matches, err := filepath.Glob(filepath.Join(rootfs, pattern))
		if err != nil {
			return "", err
		}
		for _, m := range matches {
			if err := os.Remove(m); err != nil {
				return "", err
			}
		}
	}
	return chroot, nil
}

// Debian's login scripts start a program each where the shell knows the answer:
// /etc/profile runs `id -u` (twice, once per branch) to tell root, and root's
// ~/.profile runs `mesg n` whether or not it has a terminal. A login shell is what the
// E2B SDKs run every command in (`/bin/bash -l -c …`), and under gVisor a process start
// costs more than the rest of the shell's start: measured in a 1-CPU sandbox, `bash -l
// -c true` took 55–65 ms as the user "user", 31–35 ms without the `id -u`
// (docs/benchmarks.md, twenty-third pass). quickLogin asks bash's own EUID first (dash,
// which has none, still runs `id -u`) and runs mesg only on a terminal, where it has an
// effect; a line that differs from Debian's (a later release) is left alone.
var quickLoginEdits = []struct{ file, old, new string }{
	{"etc/profile", `"$(id -u)"`, `"${EUID:-$(id -u)}"`},
	{"root/.profile", "\nmesg n 2> /dev/null || true\n", "\nif [ -t 0 ]; then mesg n 2> /dev/null || true; fi\n"},
}

func quickLogin(rootfs string) error {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	for _, e := range quickLoginEdits {
		b, err := root.ReadFile(e.file)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), e.old) {
			continue
		}
		fi, err := root.Stat(e.file)
		if err != nil {
			return err
		}
		if err := root.WriteFile(e.file, []byte(strings.ReplaceAll(string(b), e.old, e.new)), fi.Mode().Perm()); err != nil {
			return err
		}
	}
	return nil
}

// run runs a build command as PID 1 of a new PID namespace, in a private mount namespace
// (util-linux unshare sets the propagation to private), with a clean environment. When
// ctx ends the process is killed, and with it the whole namespace; Wait returns only after
// the kernel has reaped every process in it. Lines starting with "I: ", "W: " or "E: "
// go to progress; all output goes to the debug log, and the last lines into the error.
func (b *Builder) run(ctx context.Context, progress func(string), name string, args ...string) error {
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		return errors.New("unshare not found: install the Debian package util-linux")
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	defer pr.Close()
	cmd := exec.CommandContext(ctx, unshare, append([]string{"--mount", "--propagation", "private", "--", name}, args...)...)
	cmd.Env = buildEnv()
	cmd.Stdout = pw
	cmd.Stderr = pw
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWPID,
		Pdeathsig:  syscall.SIGKILL,
	}
	err = cmd.Start()
	pw.Close()
	if err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	log := b.logger()
	var tail []string
	sc := bufio.NewScanner(pr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		log.DebugContext(ctx, "template: build output", "cmd", filepath.Base(name), "line", line)
		if progress != nil && (strings.HasPrefix(line, "I: ") || strings.HasPrefix(line, "W: ") || strings.HasPrefix(line, "E: ")) {
			progress(line)
		}
		if tail = append(tail, line); len(tail) > 15 {
			tail = tail[1:]
		}
	}
	waitErr := cmd.Wait()
	if ctxErr := ctx.Err(); ctxErr != nil {
		return ctxErr
	}
	if waitErr != nil {
		return fmt.Errorf("%w\n%s", waitErr, strings.Join(tail, "\n"))
	}
	return sc.Err()
}

// targetDevScript runs "$@" with the build target "$0" on a mount of its own that allows
// device nodes. The store is mounted nodev (docs/security.md, "Storage"), and debootstrap
// refuses a nodev target: it and package scripts need the device nodes it makes in
// target/dev (/dev/null) to work. The mount exists only in the command's private mount
// namespace and goes away with it; nosuid stays.
const targetDevScript = `mount --bind -- "$0" "$0" && mount -o remount,bind,dev -- "$0" && exec "$@"`

// runInTarget is run for a command that works on the build target directory target
// (debootstrap, chroot), with device nodes allowed there (targetDevScript).
func (b *Builder) runInTarget(ctx context.Context, progress func(string), target, name string, args ...string) error {
	sh, err := exec.LookPath("sh")
	if err != nil {
		return errors.New("sh not found")
	}
	return b.run(ctx, progress, sh, append([]string{"-c", targetDevScript, target, name}, args...)...)
}

// buildEnv is the environment of build commands: a fixed PATH and locale, plus the
// host's proxy settings, which debootstrap may need to reach its mirror.
func buildEnv() []string {
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"LC_ALL=C",
		"HOME=/root",
		"DEBIAN_FRONTEND=noninteractive",
	}
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch strings.ToLower(k) {
		case "http_proxy", "https_proxy", "no_proxy":
			env = append(env, kv)
		}
	}
	return env
}
