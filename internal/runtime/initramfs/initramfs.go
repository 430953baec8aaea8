// Package initramfs owns the initial RAM filesystems the VM runtimes boot: space-agent
// as /init plus the kernel modules the guest needs, laid out as package vmboot expects,
// and their cache (Cache). Each runtime picks its own modules (ResolveModules); the
// archive is an uncompressed newc cpio (Write): the kernel unpacks it faster than a
// compressed one, which matters under TCG.
package initramfs

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spacedev/space/internal/guest/vmboot"
)

// ResolveModules returns the module files (absolute paths) to load for the modules
// named in want, in load order (dependencies first), from modulesDir's modules.dep and
// modules.builtin. Modules the kernel has built in are skipped, and so are those missing
// modules for which optional (which may be nil) reports true; any other missing module
// is an error. A kernel without modules.dep is assumed to have everything built in.
func ResolveModules(modulesDir string, want []string, optional func(name string) bool) ([]string, error) {
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
			if optional != nil && optional(name) {
				continue
			}
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

// Write writes an initramfs (an uncompressed newc cpio archive) holding agent as /init
// and modules (files, in load order) laid out as package vmboot expects.
func Write(w io.Writer, agent string, modules []string) error {
	cw := &cpioWriter{w: bufio.NewWriterSize(w, 1<<20)}
	for _, d := range []string{"dev", "proc", "sys", "newroot", strings.TrimPrefix(vmboot.ModulesDir, "/")} {
		cw.header(d, syscall.S_IFDIR|0o755, 0, 0, 0)
	}
	// The kernel opens /dev/console for init's stdio before anything is mounted; it
	// fails while the console driver (a module) is not loaded, and then the Go runtime
	// opens /dev/null on the missing descriptors 0-2 (and dies without it).
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
