package initramfs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// format versions the initramfs layout; it is part of the cache key.
const format = 1

// Cache builds initramfs images and keeps them in Dir. Images are keyed by the agent's
// content and the kernel's and modules' identity (path, size, mtime), so a new agent
// binary gets a new image while running VMs keep theirs. Set the fields before the first
// Build; a Cache is safe for concurrent use and must not be copied after first use.
type Cache struct {
	// Dir holds the images, <key>.cpio; it is created on the first build.
	Dir string
	// KernelPath, when set, is the kernel the images are booted with: part of the key.
	KernelPath string
	// Modules are the module files each image holds, in load order (ResolveModules).
	Modules []string
	// WorldReadable makes Dir and the images readable by everyone (0755 and 0644), for
	// VMMs that open them as another user; otherwise only the owner may (0700 and 0600).
	WorldReadable bool
	// Logger receives a record per image built (default: discard).
	Logger *slog.Logger

	buildMu sync.Mutex // image builds
	hashMu  sync.Mutex
	hashes  map[string]string // fileHash's memo
}

// Build returns the path of the image holding agent as /init plus c.Modules, building it
// on first use (into a temporary file renamed into place: never half-written).
func (c *Cache) Build(ctx context.Context, agent string) (string, error) {
	sum, err := c.fileHash(agent)
	if err != nil {
		return "", fmt.Errorf("initramfs: hash agent: %w", err)
	}
	h := sha256.New()
	fmt.Fprintf(h, "format %d\nagent %s\n", format, sum)
	files := c.Modules
	if c.KernelPath != "" {
		files = append([]string{c.KernelPath}, c.Modules...)
	}
	for _, p := range files {
		fi, err := os.Stat(p)
		if err != nil {
			return "", fmt.Errorf("initramfs: %w", err)
		}
		fmt.Fprintf(h, "%s %d %d\n", p, fi.Size(), fi.ModTime().UnixNano())
	}
	img := filepath.Join(c.Dir, hex.EncodeToString(h.Sum(nil))[:32]+".cpio")
	if _, err := os.Stat(img); err == nil {
		return img, nil
	}
	c.buildMu.Lock()
	defer c.buildMu.Unlock()
	if _, err := os.Stat(img); err == nil {
		return img, nil
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	start := time.Now()
	dirMode := os.FileMode(0o700)
	if c.WorldReadable {
		dirMode = 0o755
	}
	if err := os.MkdirAll(c.Dir, dirMode); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	tmp, err := os.CreateTemp(c.Dir, ".build-*")
	if err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	defer os.Remove(tmp.Name())
	if err := Write(tmp, agent, c.Modules); err != nil {
		tmp.Close()
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if c.WorldReadable {
		if err := tmp.Chmod(0o644); err != nil {
			tmp.Close()
			return "", fmt.Errorf("initramfs: %w", err)
		}
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if err := os.Rename(tmp.Name(), img); err != nil {
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if c.Logger != nil {
		c.Logger.InfoContext(ctx, "initramfs built", "path", img, "modules", len(c.Modules), "duration", time.Since(start))
	}
	return img, nil
}

// fileHash returns the sha256 of a file's content, memoized by its identity (device,
// inode, size, mtime) for the life of the Cache.
func (c *Cache) fileHash(p string) (string, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return "", err
	}
	key := ""
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		key = fmt.Sprintf("%s|%d|%d|%d|%d", p, st.Dev, st.Ino, fi.Size(), fi.ModTime().UnixNano())
	}
	c.hashMu.Lock()
	sum, ok := c.hashes[key]
	c.hashMu.Unlock()
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
		c.hashMu.Lock()
		if c.hashes == nil {
			c.hashes = map[string]string{}
		}
		c.hashes[key] = sum
		c.hashMu.Unlock()
	}
	return sum, nil
}
