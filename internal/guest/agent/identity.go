package agent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// rndReseedCRNG is the RNDRESEEDCRNG ioctl (_IO('R', 0x07)).
const rndReseedCRNG = 0x5207

// clockSkew is the difference from the host's clock that makes the agent set the clock.
const clockSkew = 50 * time.Millisecond

// applyIdentity gives the sandbox its identity and lets user code run again (the
// identity request of a kept transport).
func (a *Agent) applyIdentity(id wire.Identity) error {
	if err := a.setIdentity(id); err != nil {
		return err
	}
	// User code may run again now that the sandbox has its own entropy and clock.
	a.thaw()
	return nil
}

// setIdentity gives the sandbox its identity; user code stays frozen (the caller
// thaws it). Entropy and clock failures are logged, not returned: gVisor refuses some
// of them and the sandbox stays usable. An older generation than the current one is
// refused; the same one is applied again.
func (a *Agent) setIdentity(id wire.Identity) error {
	a.idMu.Lock()
	defer a.idMu.Unlock()
	if id.Generation < a.generation {
		return &apiError{status: http.StatusConflict, code: wire.ErrCodeStaleGeneration,
			msg: fmt.Sprintf("generation %d is older than %d", id.Generation, a.generation)}
	}
	if len(id.Seed) > 0 {
		if err := addEntropy(id.Seed); err != nil {
			a.log.Warn("reseed entropy pool", "err", err)
		}
	}
	if id.UnixNano != 0 {
		host := time.Unix(0, id.UnixNano)
		if d := time.Since(host); d > clockSkew || d < -clockSkew {
			ts := unix.NsecToTimespec(id.UnixNano)
			if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
				a.log.Warn("set clock", "skew", d, "err", err)
			} else {
				a.log.Info("clock set", "skew", d)
			}
		}
	}
	if id.Hostname != "" {
		if cur, err := os.Hostname(); err != nil || cur != id.Hostname {
			if err := unix.Sethostname([]byte(id.Hostname)); err != nil {
				a.log.Warn("set hostname", "hostname", id.Hostname, "err", err)
			}
		}
		// Programs that look their host name up (sudo, Java, Python's getfqdn) find it
		// in /etc/hosts, as on a Debian machine. Only inside a sandbox, where the agent
		// is PID 1 and /etc is the sandbox's: a test agent on the host leaves it alone.
		// The name in force is named too: a runtime may refuse sethostname (then the
		// sandbox keeps the name its runtime gave it).
		if os.Getpid() == 1 {
			names := []string{id.Hostname}
			if cur, err := os.Hostname(); err == nil && cur != id.Hostname {
				names = append(names, cur)
			}
			if err := ensureHostsEntry("/etc/hosts", names...); err != nil {
				a.log.Warn("name the host in /etc/hosts", "hostname", id.Hostname, "err", err)
			}
		}
	}
	a.defaultEnv = maps.Clone(id.Env)
	a.generation = id.Generation
	a.tasks.refresh() // a restore may have changed the sandbox's task limit
	return nil
}

// hostsMarker ends the /etc/hosts line the agent maintains.
const hostsMarker = "# space: this sandbox's host name"

// ensureHostsEntry makes hosts name each of names: a line of its own mapping 127.0.1.1
// to those no other line names (as Debian's installer does), ending with hostsMarker,
// replacing the line it wrote before.
func ensureHostsEntry(hosts string, names ...string) error {
	data, err := os.ReadFile(hosts)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if len(data) > 1<<20 {
		return fmt.Errorf("%s is larger than 1 MiB", hosts)
	}
	var keep []string
	named := map[string]bool{}
	for _, line := range strings.Split(strings.TrimRight(string(data), "\n"), "\n") {
		if strings.HasSuffix(line, hostsMarker) {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) > 1 && !strings.HasPrefix(fields[0], "#") {
			for _, f := range fields[1:] {
				named[f] = true
			}
		}
		if line != "" || len(keep) > 0 {
			keep = append(keep, line)
		}
	}
	var missing []string
	for _, n := range names {
		if n != "" && !named[n] && !slices.Contains(missing, n) {
			missing = append(missing, n)
		}
	}
	if len(missing) == 0 && !strings.Contains(string(data), hostsMarker) {
		return nil // the file names the host itself
	}
	if len(missing) > 0 {
		keep = append(keep, "127.0.1.1\t"+strings.Join(missing, " ")+"\t"+hostsMarker)
	}
	content := []byte(strings.Join(keep, "\n") + "\n")
	if bytes.Equal(content, data) {
		return nil // as it was: a warm-pool member keeps its host name when claimed
	}
	tmp := hosts + ".space-tmp"
	if err := os.WriteFile(tmp, content, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, hosts); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// addEntropy mixes seed into the kernel pool and credits it (RNDADDENTROPY); where
// that is refused it writes to /dev/urandom, which mixes without crediting.
func addEntropy(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("open /dev/urandom: %w", err)
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+(len(seed)+3)/4*4)
	binary.NativeEndian.PutUint32(info[0:4], uint32(len(seed)*8))
	binary.NativeEndian.PutUint32(info[4:8], uint32(len(seed)))
	copy(info[8:], seed)
	ioctlErr := ioctlPtr(int(f.Fd()), unix.RNDADDENTROPY, unsafe.Pointer(&info[0]))
	if ioctlErr == nil {
		// Make the kernel's CRNG use the new entropy now, not at its next timed reseed:
		// clones restored from one snapshot would read identical bytes until then.
		_ = unix.IoctlSetInt(int(f.Fd()), rndReseedCRNG, 0)
		return nil
	}
	if _, err := f.Write(seed); err != nil {
		return fmt.Errorf("RNDADDENTROPY: %v; write /dev/urandom: %w", ioctlErr, err)
	}
	return nil
}

func ioctlPtr(fd int, req uint, arg unsafe.Pointer) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg))
	if errno != 0 {
		return errno
	}
	return nil
}
