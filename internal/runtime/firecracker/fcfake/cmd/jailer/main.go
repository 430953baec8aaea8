// Command jailer is fcfake's drop-in for Firecracker's jailer. It parses the jailer's
// command line as strictly as the jailer (required arguments, id syntax, an exec file
// whose name contains "firecracker", cgroup and resource-limit syntax), then does what
// the jailer does to the host that a test can observe: it creates
// <chroot-base-dir>/<exec file name>/<id>/root, copies the exec file into it, creates the
// /dev/kvm and /dev/net/tun nodes there, gives the root to --uid:--gid, creates the
// instance's cgroup (v2) under <parent cgroup>/<id> and checks --netns, and finally
// executes the copied binary with "--id=<id> --start-time-us=... --start-time-cpu-us=..."
// and the arguments after "--", in the same process (same pid), like the jailer.
//
// What it does not do: enter a mount namespace, pivot_root, setns or drop privileges (a Go
// program cannot unshare its mount namespace, and the tests that run it need the fake
// firecracker to reach their sockets). Instead it hands the chroot and the uid/gid to the
// fake firecracker (fcfake.EnvRoot, EnvUID, EnvGID), which resolves every path inside the
// chroot and checks permissions as that uid/gid would. The cgroup is created under
// fcfake.Config.CgroupRoot (a plain directory in tests) and the values of --cgroup are
// recorded, with the arguments, in Config.JailerRecord.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime/firecracker/fcfake"
)

// Invocation is what the fake jailer records per run.
type Invocation struct {
	Args      []string          `json:"args"`
	Chroot    string            `json:"chroot"`
	CgroupDir string            `json:"cgroup_dir,omitempty"`
	Cgroup    map[string]string `json:"cgroup,omitempty"`
	NetNS     string            `json:"netns,omitempty"`
}

type options struct {
	id, execFile, chrootBase, parentCgroup, netns string
	uid, gid, cgroupVersion                       int
	cgroups                                       map[string]string
	limits                                        []string
	daemonize                                     bool
	extra                                         []string
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "Jailer error:", err)
		os.Exit(1)
	}
}

func run(argv []string) error {
	cfg, cfgPath, err := fcfake.LoadConfig()
	if err != nil {
		return err
	}
	if len(argv) == 1 && argv[0] == "--version" {
		fmt.Printf("Jailer v%s\n", cfg.Version)
		return nil
	}
	o, err := parse(argv)
	if err != nil {
		return fmt.Errorf("arguments parsing error: %w", err)
	}
	name := filepath.Base(o.execFile)
	chroot := filepath.Join(o.chrootBase, name, o.id, "root")
	if err := os.MkdirAll(chroot, 0o755); err != nil {
		return err
	}
	if err := copyFile(o.execFile, filepath.Join(chroot, name)); err != nil {
		return fmt.Errorf("copy exec file: %w", err)
	}
	inv := Invocation{Args: argv, Chroot: chroot, NetNS: o.netns}
	if o.cgroupVersion == 2 {
		if cfg.CgroupRoot == "" {
			return errors.New("fcfake jailer: cgroup_root not configured")
		}
		parent := o.parentCgroup
		if parent == "" {
			parent = name
		}
		inv.CgroupDir = filepath.Join(cfg.CgroupRoot, parent, o.id)
		if err := os.MkdirAll(inv.CgroupDir, 0o755); err != nil {
			return fmt.Errorf("create cgroup: %w", err)
		}
		inv.Cgroup = o.cgroups
	} else if len(o.cgroups) > 0 {
		return errors.New("fcfake jailer: cgroup v1 is not emulated")
	}
	if o.netns != "" {
		if _, err := os.Stat(o.netns); err != nil {
			return fmt.Errorf("netns: %w", err)
		}
	}
	for _, d := range []struct {
		path         string
		major, minor uint32
	}{{"dev/kvm", 10, 232}, {"dev/net/tun", 10, 200}} {
		p := filepath.Join(chroot, d.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := unix.Mknod(p, unix.S_IFCHR|0o600, int(unix.Mkdev(d.major, d.minor))); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("mknod %s: %w", d.path, err)
		}
		if err := os.Lchown(p, o.uid, o.gid); err != nil {
			return err
		}
	}
	if err := os.Lchown(chroot, o.uid, o.gid); err != nil {
		return fmt.Errorf("chown chroot: %w", err)
	}
	if cfg.JailerRecord != "" {
		if err := fcfake.AppendJSONLine(cfg.JailerRecord, inv); err != nil {
			return err
		}
	}
	if o.daemonize {
		if _, err := unix.Setsid(); err != nil {
			return fmt.Errorf("setsid: %w", err)
		}
	}
	if err := os.Chdir(chroot); err != nil {
		return err
	}
	now := time.Now()
	args := append([]string{"/" + name,
		"--id=" + o.id,
		"--start-time-us=" + strconv.FormatInt(now.UnixMicro(), 10),
		"--start-time-cpu-us=0",
	}, o.extra...)
	env := []string{
		fcfake.EnvRoot + "=" + chroot,
		fcfake.EnvUID + "=" + strconv.Itoa(o.uid),
		fcfake.EnvGID + "=" + strconv.Itoa(o.gid),
	}
	if p := o.execFile + ".json"; fileExists(p) {
		env = append(env, fcfake.EnvConfig+"="+p)
	} else if cfgPath != "" {
		env = append(env, fcfake.EnvConfig+"="+cfgPath)
	}
	return syscall.Exec(filepath.Join(chroot, name), args, env)
}

// parse parses the jailer's arguments (docs/jailer.md).
func parse(argv []string) (options, error) {
	idRE := regexp.MustCompile(`^[a-zA-Z0-9-]{1,64}$`)
	o := options{chrootBase: "/srv/jailer", cgroupVersion: 1, cgroups: map[string]string{}, uid: -1, gid: -1}
	values := map[string]bool{
		"id": true, "exec-file": true, "uid": true, "gid": true, "parent-cgroup": true,
		"cgroup-version": true, "cgroup": true, "chroot-base-dir": true, "netns": true,
		"resource-limit": true, "daemonize": false, "new-pid-ns": false,
	}
	seen := map[string]bool{}
	for i := 0; i < len(argv); i++ {
		a := argv[i]
		if a == "--" {
			o.extra = argv[i+1:]
			break
		}
		name, val, hasVal := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		takes, known := values[name]
		if !strings.HasPrefix(a, "--") || !known {
			return o, fmt.Errorf("unexpected argument %q", a)
		}
		if seen[name] && name != "cgroup" && name != "resource-limit" {
			return o, fmt.Errorf("argument --%s given twice", name)
		}
		seen[name] = true
		if takes && !hasVal {
			if i+1 >= len(argv) {
				return o, fmt.Errorf("argument --%s needs a value", name)
			}
			i++
			val = argv[i]
		}
		var err error
		switch name {
		case "id":
			if !idRE.MatchString(val) {
				return o, fmt.Errorf("invalid id %q: alphanumerics and hyphens, at most 64", val)
			}
			o.id = val
		case "exec-file":
			if !strings.Contains(filepath.Base(val), "firecracker") {
				return o, fmt.Errorf("exec file name %q must contain \"firecracker\"", val)
			}
			if fi, serr := os.Stat(val); serr != nil || !fi.Mode().IsRegular() {
				return o, fmt.Errorf("exec file %q is not a regular file", val)
			}
			o.execFile = val
		case "uid":
			o.uid, err = strconv.Atoi(val)
		case "gid":
			o.gid, err = strconv.Atoi(val)
		case "parent-cgroup":
			if filepath.IsAbs(val) || strings.Contains(val, "..") {
				return o, fmt.Errorf("parent cgroup %q must be a relative path", val)
			}
			o.parentCgroup = val
		case "cgroup-version":
			o.cgroupVersion, err = strconv.Atoi(val)
			if err == nil && o.cgroupVersion != 1 && o.cgroupVersion != 2 {
				return o, fmt.Errorf("cgroup version %q: want 1 or 2", val)
			}
		case "cgroup":
			file, v, ok := strings.Cut(val, "=")
			if !ok || !strings.Contains(file, ".") || strings.Contains(file, "/") || v == "" {
				return o, fmt.Errorf("cgroup %q: want <file>=<value>", val)
			}
			o.cgroups[file] = v
		case "chroot-base-dir":
			if !filepath.IsAbs(val) {
				return o, fmt.Errorf("chroot base dir %q is not absolute", val)
			}
			o.chrootBase = val
		case "netns":
			o.netns = val
		case "resource-limit":
			res, v, ok := strings.Cut(val, "=")
			if _, perr := strconv.ParseUint(v, 10, 64); !ok || perr != nil || (res != "fsize" && res != "no-file") {
				return o, fmt.Errorf("resource limit %q: want fsize=N or no-file=N", val)
			}
			o.limits = append(o.limits, val)
		case "daemonize":
			o.daemonize = true
		case "new-pid-ns":
			return o, errors.New("fcfake jailer: --new-pid-ns is not emulated")
		}
		if err != nil {
			return o, fmt.Errorf("--%s %q: %w", name, val, err)
		}
	}
	switch {
	case o.id == "":
		return o, errors.New("missing --id")
	case o.execFile == "":
		return o, errors.New("missing --exec-file")
	case o.uid < 0 || o.gid < 0:
		return o, errors.New("missing --uid or --gid")
	}
	return o, nil
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
