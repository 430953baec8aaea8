package gvisor

import (
	"errors"
	"fmt"
	"path/filepath"
	"syscall"
)

// UnpinNullNetNS unmounts the empty network namespace runsc pins for its gofers in its
// root dir (a mount the root dir keeps for the host's lifetime), so that the root dir
// can be removed: for tests and benchmarks that make a root dir of their own. runsc
// processes that start together each pin one (measured: 3–4 stacked mounts after 4
// concurrent creates), and one unmount leaves the others, so this unmounts until
// nothing is mounted there.
func UnpinNullNetNS(root string) error {
	p := filepath.Join(root, "null-netns")
	for range 256 {
		err := syscall.Unmount(p, syscall.MNT_DETACH)
		if errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOENT) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("unmount %s: %w", p, err)
		}
	}
	return fmt.Errorf("unmount %s: still mounted after 256 unmounts", p)
}
