package storage

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/fault"
)

// DefaultDiskReserve is the default of the operator's --disk-reserve flag: creating or
// waking a sandbox must leave 10 % of each file system under the store free.
const DefaultDiskReserve = 0.10

// FSSpace is the space of one file system the store lives on.
type FSSpace struct {
	// Name says which one: "store" (the btrfs volume), or "host" (the file system that
	// holds the store's image file, when the store is image-backed).
	Name string
	// Path is where it was measured.
	Path string
	// TotalBytes is its size; FreeBytes what unprivileged writers may still use
	// (statfs f_bavail). For btrfs both are the kernel's estimate.
	TotalBytes, FreeBytes int64
}

// Space measures the file systems under the store: the btrfs volume and, for an image
// file, the host file system holding it (a sparse image can run out of host space long
// before it is full itself).
func (s *Store) Space() ([]FSSpace, error) {
	paths := []FSSpace{{Name: "store", Path: s.root}}
	if s.image != "" {
		paths = append(paths, FSSpace{Name: "host", Path: filepath.Dir(s.image)})
	}
	for i := range paths {
		var st unix.Statfs_t
		if err := unix.Statfs(paths[i].Path, &st); err != nil {
			return nil, fmt.Errorf("storage: statfs %s: %w", paths[i].Path, err)
		}
		paths[i].TotalBytes = int64(st.Blocks) * st.Bsize
		paths[i].FreeBytes = int64(st.Bavail) * st.Bsize
	}
	return paths, nil
}

// CheckSpace reports whether something that needs about need bytes of new disk space (a
// sandbox's writable disk, a suspend snapshot's memory file) can be made without taking
// the free space of any file system under the store below the reserve (Config.DiskReserve
// of its size). If not, the error has kind fault.InsufficientStorage and says which file
// system, how much is free and how much is kept.
func (s *Store) CheckSpace(need int64) error {
	if need < 0 {
		return fault.New(fault.Invalid, "negative space request %d", need)
	}
	fss, err := s.Space()
	if err != nil {
		return err
	}
	for _, f := range fss {
		keep := int64(s.reserve * float64(f.TotalBytes))
		if f.FreeBytes-need >= keep {
			continue
		}
		what := "the store's file system"
		if f.Name == "host" {
			what = "the file system holding the store's image"
		}
		return fault.New(fault.InsufficientStorage,
			"not enough disk space: this needs %s, %s (%s) has %s free of %s, and %s (%s) is kept free",
			formatBytes(need), what, f.Path, formatBytes(f.FreeBytes), formatBytes(f.TotalBytes),
			formatBytes(keep), formatPercent(s.reserve))
	}
	return nil
}

// ParseDiskReserve parses a reserve for Config.DiskReserve: a percentage ("10%") or a
// fraction ("0.1"), from 0 up to, not including, 100 %.
func ParseDiskReserve(v string) (float64, error) {
	v = strings.TrimSpace(v)
	pct := strings.HasSuffix(v, "%")
	f, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
	if err != nil {
		return 0, fmt.Errorf("disk reserve %q: want a percentage like 10%% or a fraction like 0.1", v)
	}
	if pct {
		f /= 100
	}
	if f < 0 || f >= 1 {
		return 0, fmt.Errorf("disk reserve %q: must be from 0 up to, not including, 100%%", v)
	}
	return f, nil
}

func formatPercent(f float64) string {
	return strconv.FormatFloat(f*100, 'f', -1, 64) + " %"
}

// formatBytes renders n in binary units with one decimal ("1.5 GiB").
func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTP"[exp])
}
