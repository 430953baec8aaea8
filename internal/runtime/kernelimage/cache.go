package kernelimage

import (
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// ErrNoPVH is returned for an ELF kernel without a PVH entry point.
var ErrNoPVH = errors.New("kernelimage: the kernel has no PVH entry point (built without CONFIG_PVH)")

// format versions the cache's file layout; it is part of the key.
const format = 1

// cacheSuffix names the extracted kernels in a Cache's Dir.
const cacheSuffix = ".vmlinux"

// Cache keeps the uncompressed kernels extracted from bzImages in Dir, one file per
// kernel content, readable by everyone (VMMs running as unprivileged users map them).
type Cache struct {
	// Dir holds the kernels, <key>.vmlinux; created on first use.
	Dir string
	// Logger receives what was extracted and how long it took (default: discard).
	Logger *slog.Logger
}

// PVH returns the path of a PVH-bootable ELF kernel for kernel (see ELF), or an error
// wrapping ErrUnsupported or ErrNoPVH when kernel cannot be booted that way.
func (c *Cache) PVH(ctx context.Context, kernel string) (string, error) {
	p, err := c.ELF(ctx, kernel)
	if err != nil {
		return "", err
	}
	if _, ok, err := PVHEntry(p); err != nil {
		return "", err
	} else if !ok {
		return "", ErrNoPVH
	}
	return p, nil
}

// ELF returns the path of an x86-64 ELF kernel for kernel: kernel itself when it is
// one, else the vmlinux inside it, extracted on first use into a temporary file that is
// checked, fsynced and renamed into place (never half-written). Kernels extracted from other
// images are removed from Dir: only one kernel is current. It fails with ErrUnsupported
// when kernel is neither.
func (c *Cache) ELF(ctx context.Context, kernel string) (string, error) {
	isELF, err := IsELF(kernel)
	if err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	if isELF {
		if err := checkELF(kernel); err != nil {
			return "", err
		}
		return kernel, nil
	}
	f, err := os.Open(kernel)
	if err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	p, err := Locate(f, fi.Size())
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "format %d\n", format)
	if _, err := io.Copy(h, io.NewSectionReader(f, 0, fi.Size())); err != nil {
		return "", fmt.Errorf("kernelimage: hash %s: %w", kernel, err)
	}
	out := filepath.Join(c.Dir, hex.EncodeToString(h.Sum(nil))[:32]+cacheSuffix)
	if st, err := os.Stat(out); err == nil && st.Size() == p.Size && checkELF(out) == nil {
		return out, nil
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	start := time.Now()
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	tmp, err := os.CreateTemp(c.Dir, ".extract-*")
	if err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := Extract(f, fi.Size(), tmp); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	// On disk before its name is: after a host crash the name may be gone (it is
	// extracted again), never on a file of the right size holding zeros.
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", fmt.Errorf("kernelimage: fsync: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	if err := checkELF(tmp.Name()); err != nil {
		return "", fmt.Errorf("kernelimage: the kernel inside %s: %w", kernel, err)
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return "", fmt.Errorf("kernelimage: %w", err)
	}
	c.removeOthers(out)
	if c.Logger != nil {
		c.Logger.InfoContext(ctx, "kernel extracted", "from", kernel, "path", out,
			"compression", p.Compression, "bytes", p.Size, "duration", time.Since(start))
	}
	return out, nil
}

// checkELF checks that path is an x86-64 ELF.
func checkELF(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrUnsupported, path, err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 {
		return fmt.Errorf("%w: %s is a %s ELF, not x86-64", ErrUnsupported, path, f.Machine)
	}
	return nil
}

// removeOthers removes the kernels in Dir other than keep (extracted from kernels no
// longer configured), and temporary files a crash left (an hour old: not another
// extraction's).
func (c *Cache) removeOthers(keep string) {
	entries, err := os.ReadDir(c.Dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		p := filepath.Join(c.Dir, e.Name())
		stale := strings.HasSuffix(e.Name(), cacheSuffix) && p != keep
		if strings.HasPrefix(e.Name(), ".extract-") {
			if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > time.Hour {
				stale = true
			}
		}
		if !stale {
			continue
		}
		if err := os.Remove(p); err != nil && c.Logger != nil {
			c.Logger.Warn("remove old extracted kernel", "path", p, "err", err)
		}
	}
}
