package firecracker

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/guest/vmboot"
)

// The initramfs follows package vmboot's contract (the same layout the QEMU runtime
// builds): space-agent as /init, the kernel modules the guest needs in /modules with
// their load order. This package builds its own because Firecracker's guests need
// different modules: no virtio console or serial port, but the vsock transport.

// guestModules are the modules a Firecracker guest needs before it can mount its root
// disk and serve the agent: virtio over MMIO (described by Firecracker through ACPI and
// on the kernel command line), the block device, the vsock transport, and ext4.
// Whatever the kernel has built in is skipped; dependencies come from modules.dep.
func guestModules() []string {
	return []string{"virtio_mmio", "virtio_blk", "vmw_vsock_virtio_transport", "ext4"}
}

// resolveModules returns the module files (absolute paths) to load for want, in load
// order (dependencies first), from modulesDir's modules.dep and modules.builtin. A
// kernel without modules.dep is assumed to have everything built in (as Firecracker's
// recommended guest configurations do).
func resolveModules(modulesDir string, want []string) ([]string, error) {
	if modulesDir == "" {
		return nil, nil
	}
	deps, err := readModulesDep(filepath.Join(modulesDir, "modules.dep"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	builtin := map[string]bool{}
	if data, err := os.ReadFile(filepath.Join(modulesDir, "modules.builtin")); err == nil {
		for _, line := range strings.Fields(string(data)) {
			builtin[vmboot.ModuleName(line)] = true
		}
	}
	byName := map[string]string{}
	for file := range deps {
		byName[vmboot.ModuleName(file)] = file
	}
	var order []string
	seen := map[string]bool{}
	var visit func(file string)
	visit = func(file string) {
		if seen[file] {
			return
		}
		seen[file] = true
		for _, d := range deps[file] {
			visit(d)
		}
		order = append(order, file)
	}
	for _, name := range want {
		if builtin[name] {
			continue
		}
		file, ok := byName[name]
		if !ok {
			return nil, fmt.Errorf("kernel module %s is neither built in nor in %s", name, modulesDir)
		}
		visit(file)
	}
	out := make([]string, len(order))
	for i, f := range order {
		out[i] = filepath.Join(modulesDir, f)
	}
	return out, nil
}

// readModulesDep parses modules.dep: "path: dep1 dep2 ...", paths relative to the
// modules directory.
func readModulesDep(p string) (map[string][]string, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	deps := map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		mod, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		deps[strings.TrimSpace(mod)] = strings.Fields(rest)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	return deps, nil
}

// initramfsDir is where built initramfs images are cached, under the root dir.
const initramfsDir = "initramfs"

// initramfsFormat versions the initramfs layout; it is part of the cache key.
const initramfsFormat = 1

// initramfs returns the path of an initramfs holding agent as /init plus the guest
// modules, building and caching it on first use. Images are keyed by the agent's
// content and the modules' identity, so a new agent binary gets a new image while
// running VMs keep theirs (each jail holds a hard link or copy). Images are readable by
// everyone: the jailed firecracker opens them as the jailer user.
func (r *Runtime) initramfs(ctx context.Context, agent string) (string, error) {
	sum, err := r.fileHash(agent)
	if err != nil {
		return "", fmt.Errorf("initramfs: hash agent: %w", err)
	}
	h := sha256.New()
	fmt.Fprintf(h, "format %d\nagent %s\n", initramfsFormat, sum)
	for _, p := range r.modules {
		fi, err := os.Stat(p)
		if err != nil {
			return "", fmt.Errorf("initramfs: %w", err)
		}
		fmt.Fprintf(h, "%s %d %d\n", p, fi.Size(), fi.ModTime().UnixNano())
	}
	dir := filepath.Join(r.cfg.RootDir, initramfsDir)
	img := filepath.Join(dir, hex.EncodeToString(h.Sum(nil))[:32]+".cpio")
	if _, err := os.Stat(img); err == nil {
		return img, nil
	}
	r.buildMu.Lock()
	defer r.buildMu.Unlock()
	if _, err := os.Stat(img); err == nil {
		return img, nil
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	start := time.Now()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".build-*")
	if err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	defer os.Remove(tmp.Name())
	if err := writeInitramfs(tmp, agent, r.modules); err != nil {
		tmp.Close()
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if err := os.Rename(tmp.Name(), img); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	r.log.InfoContext(ctx, "initramfs built", "path", img, "modules", len(r.modules), "duration", time.Since(start))
	return img, nil
}

// fileHash returns the sha256 of a file's content, memoized by its identity (device,
// inode, size, mtime) for the life of the Runtime.
func (r *Runtime) fileHash(p string) (string, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return "", err
	}
	key := ""
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		key = fmt.Sprintf("%s|%d|%d|%d|%d", p, st.Dev, st.Ino, fi.Size(), fi.ModTime().UnixNano())
	}
	r.hashMu.Lock()
	sum, ok := r.hashes[key]
	r.hashMu.Unlock()
	if ok && key != "" {
		return sum, nil
	}
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	sum = hex.EncodeToString(h.Sum(nil))
	if key != "" {
		r.hashMu.Lock()
		r.hashes[key] = sum
		r.hashMu.Unlock()
	}
	return sum, nil
}

// writeInitramfs writes the initramfs (an uncompressed newc cpio archive) laid out as
// package vmboot expects.
func writeInitramfs(w io.Writer, agent string, modules []string) error {
	cw := &cpioWriter{w: bufio.NewWriterSize(w, 1<<20)}
	for _, d := range []string{"dev", "proc", "sys", "newroot", strings.TrimPrefix(vmboot.ModulesDir, "/")} {
		cw.header(d, syscall.S_IFDIR|0o755, 0, 0, 0)
	}
	// The kernel opens /dev/console for init's stdio before anything is mounted; without
	// it the Go runtime needs /dev/null for the missing descriptors 0-2.
	cw.header("dev/console", syscall.S_IFCHR|0o600, 0, 5, 1)
	cw.header("dev/null", syscall.S_IFCHR|0o666, 0, 1, 3)
	if err := cw.file(strings.TrimPrefix(vmboot.InitPath, "/"), agent, 0o755); err != nil {
		return err
	}
	var order strings.Builder
	for _, m := range modules {
		name := path.Join(strings.TrimPrefix(vmboot.ModulesDir, "/"), filepath.Base(m))
		if err := cw.file(name, m, 0o644); err != nil {
			return err
		}
		order.WriteString(filepath.Base(m) + "\n")
	}
	cw.data(strings.TrimPrefix(vmboot.ModulesOrder, "/"), []byte(order.String()), 0o644)
	cw.header("TRAILER!!!", 0, 0, 0, 0)
	if cw.err != nil {
		return cw.err
	}
	return cw.w.Flush()
}

// cpioWriter writes the "newc" (SVR4, no CRC) cpio format the kernel unpacks.
type cpioWriter struct {
	w   *bufio.Writer
	ino uint32
	n   int64 // bytes written, for padding
	err error
}

func (c *cpioWriter) write(b []byte) {
	if c.err != nil {
		return
	}
	n, err := c.w.Write(b)
	c.n += int64(n)
	c.err = err
}

func (c *cpioWriter) pad() {
	if r := c.n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// header writes an entry header and its name; size bytes of data must follow.
func (c *cpioWriter) header(name string, mode uint32, size int64, rmajor, rminor uint32) {
	c.ino++
	nlink := uint32(1)
	if mode&syscall.S_IFMT == syscall.S_IFDIR {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, nlink, 0, size, 0, 0, rmajor, rminor, len(name)+1, 0)
	c.write([]byte(hdr))
	c.write(append([]byte(name), 0))
	c.pad()
}

func (c *cpioWriter) data(name string, b []byte, perm uint32) {
	c.header(name, syscall.S_IFREG|perm, int64(len(b)), 0, 0)
	c.write(b)
	c.pad()
}

func (c *cpioWriter) file(name, src string, perm uint32) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	c.header(name, syscall.S_IFREG|perm, fi.Size(), 0, 0)
	if c.err != nil {
		return c.err
	}
	n, err := io.Copy(c.w, f)
	c.n += n
	if err != nil {
		return err
	}
	if n != fi.Size() {
		return fmt.Errorf("%s changed while being read", src)
	}
	c.pad()
	return c.err
}
