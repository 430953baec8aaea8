package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NS is a handle on a network namespace. The zero NS (and a nil *NS) stands for the
// namespace of the calling process, so that code running on a real node never switches
// namespaces; tests hand the Manager a namespace of their own as its "host".
type NS struct {
	h    netns.NsHandle
	path string
}

// OpenNS opens the namespace at path ("" = the caller's namespace, as a zero NS).
func OpenNS(path string) (*NS, error) {
	if path == "" {
		return &NS{h: -1}, nil
	}
	h, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	return &NS{h: h, path: path}, nil
}

// Path is the file the namespace was opened from ("" for the caller's namespace).
func (n *NS) Path() string {
	if n == nil {
		return ""
	}
	return n.path
}

func (n *NS) current() bool { return n == nil || n.h < 0 }

// FD is the namespace's file descriptor, or 0 (netlink libraries' "current").
func (n *NS) FD() int {
	if n.current() {
		return 0
	}
	return int(n.h)
}

func (n *NS) netlink() (*netlink.Handle, error) {
	if n.current() {
		return netlink.NewHandle()
	}
	return netlink.NewHandleAt(n.h)
}

// Close releases the handle.
func (n *NS) Close() error {
	if n.current() {
		return nil
	}
	err := n.h.Close()
	n.h = -1
	return err
}

// Do runs fn on an OS thread that is in the namespace: sockets fn creates (listeners,
// dials, the children it starts) belong to it. When the thread cannot be switched back
// it is left locked, so the Go runtime retires it instead of reusing it elsewhere.
func (n *NS) Do(fn func() error) error {
	if n.current() {
		return fn()
	}
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(n.h); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", n.path, err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		return errors.Join(ferr, fmt.Errorf("leave netns %s: %w", n.path, err))
	}
	runtime.UnlockOSThread()
	return ferr
}

// Dial connects from inside the namespace. d's Control hook (if any) runs too.
func (n *NS) Dial(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error) {
	if n.current() {
		return d.DialContext(ctx, network, addr)
	}
	var c net.Conn
	err := n.Do(func() error {
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// Listen opens a TCP listener inside the namespace.
func (n *NS) Listen(network, addr string) (net.Listener, error) {
	var l net.Listener
	err := n.Do(func() error {
		var err error
		l, err = net.Listen(network, addr)
		return err
	})
	return l, err
}

// ListenPacket opens a packet listener inside the namespace.
func (n *NS) ListenPacket(network, addr string) (net.PacketConn, error) {
	var l net.PacketConn
	err := n.Do(func() error {
		var err error
		l, err = net.ListenPacket(network, addr)
		return err
	})
	return l, err
}

// WriteSysctl sets a sysctl of the namespace ("net/ipv4/ip_forward").
func (n *NS) WriteSysctl(name, value string) error {
	return n.Do(func() error {
		if err := os.WriteFile("/proc/sys/"+name, []byte(value), 0o644); err != nil {
			return fmt.Errorf("sysctl %s=%s: %w", name, value, err)
		}
		return nil
	})
}

// nsfsMagic is the file system magic of namespace files (linux/magic.h NSFS_MAGIC).
const nsfsMagic = 0x6e736673

// isPinnedNS reports whether path is a bind mount of a namespace.
func isPinnedNS(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return st.Type == nsfsMagic
}

// createPinnedNS makes a new network namespace and pins it by bind-mounting it on
// path, the way iproute2's "ip netns add" does, so that it outlives every process in it
// (and space itself) and can be found again by name. The file must not exist.
func createPinnedNS(path string) (err error) {
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return fmt.Errorf("create netns pin: %w", err)
	}
	f.Close()
	defer func() {
		if err != nil {
			os.Remove(path)
		}
	}()
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("unshare netns: %w", err)
	}
	src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
	merr := unix.Mount(src, path, "none", unix.MS_BIND, "")
	if err := netns.Set(orig); err != nil {
		// The thread stays locked and dies with its goroutine.
		if merr == nil {
			_ = unix.Unmount(path, unix.MNT_DETACH)
		}
		return fmt.Errorf("leave new netns: %w", err)
	}
	runtime.UnlockOSThread()
	if merr != nil {
		return fmt.Errorf("pin netns on %s: %w", path, merr)
	}
	return nil
}

// CreateNamedNS makes a new network namespace pinned at path (see createPinnedNS).
func CreateNamedNS(path string) error { return createPinnedNS(path) }

// RemoveNamedNS unpins the namespace at path (see removePinnedNS).
func RemoveNamedNS(path string) error { return removePinnedNS(path) }

// removePinnedNS unpins the namespace at path; the kernel frees it when its last user
// (a process, a socket, an open handle) goes. A missing path is not an error.
func removePinnedNS(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unpin netns %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove netns pin %s: %w", path, err)
	}
	return nil
}
