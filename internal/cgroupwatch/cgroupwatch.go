// Package cgroupwatch tells when the memory charged to a host cgroup rises above a
// threshold, without polling: on cgroup v1 through a memory threshold
// (cgroup.event_control with an eventfd on memory.usage_in_bytes), on cgroup v2 through
// memory.high and the "high" count of memory.events (inotify). The gVisor runtime uses
// it to learn that a sandbox nears its host memory limit while there is still time to
// end one of its processes instead of the host's OOM killer ending the whole sandbox
// (docs/runtimes.md, "Memory").
//
// It is hand-rolled because the kernel interface is two small files per version and
// the libraries that wrap cgroups (containerd's cgroups, runc's libcontainer) bring a
// manager for every controller to use these few lines of them.
package cgroupwatch

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// ErrNoMemoryController is returned for a directory that is not a memory cgroup.
var ErrNoMemoryController = errors.New("cgroupwatch: not a memory cgroup")

// Memory calls above each time the memory charged to the cgroup dir rises above
// threshold bytes, and returns when ctx is done (nil) or the cgroup is removed (nil),
// or when it cannot watch (an error, before any call). above runs on Memory's
// goroutine, one call at a time, with the usage it was told of; rises that happen
// while it runs are coalesced into at most one more call. A rise is a crossing from
// below; usage above the threshold that keeps growing is reported again at most once
// a second (v2Quiet; on cgroup v1 once it grew by v1Growth since the last report).
//
// On cgroup v2 the threshold is set as the cgroup's memory.high, which also makes the
// kernel reclaim and slow the cgroup's allocations above it (memory a sandbox's
// processes hold in shared memory cannot be reclaimed without swap, so in practice it
// slows them); Memory sets memory.high back to "max" when it returns.
func Memory(ctx context.Context, dir string, threshold int64, above func(usage int64)) error {
	if threshold <= 0 {
		return fmt.Errorf("cgroupwatch: threshold %d", threshold)
	}
	switch {
	case exists(filepath.Join(dir, "memory.usage_in_bytes")):
		return watchV1(ctx, dir, threshold, above)
	case exists(filepath.Join(dir, "memory.events")):
		return watchV2(ctx, dir, threshold, above)
	}
	return fmt.Errorf("%w: %s", ErrNoMemoryController, dir)
}

// watchV1 registers a memory threshold: the kernel signals the eventfd whenever
// memory.usage_in_bytes crosses it, in either direction, and when the cgroup is removed.
func watchV1(ctx context.Context, dir string, threshold int64, above func(int64)) error {
	usage, err := os.Open(filepath.Join(dir, "memory.usage_in_bytes"))
	if err != nil {
		return err
	}
	defer usage.Close()
	events, err := register(dir, usage, strconv.FormatInt(threshold, 10))
	if err != nil {
		return err
	}
	defer events.Close()
	stop := closeOnDone(ctx, events)
	defer stop()
	var buf [8]byte
	// reported is the usage last reported while it stays above the threshold (0: it is
	// under it). The kernel signals crossings only: while usage stays above, the watch
	// looks again every v2Quiet and reports it again once it grew by v1Growth since (a
	// reaction that freed too little, and something goes on allocating), as v2's count
	// of charges above memory.high does. Nothing polls while usage is under it.
	var reported int64
	for {
		deadline := time.Time{}
		if reported > 0 {
			deadline = time.Now().Add(v2Quiet)
		}
		_ = events.SetReadDeadline(deadline)
		var crossings uint64
		if _, err := io.ReadFull(events, buf[:]); err == nil {
			crossings = binary.NativeEndian.Uint64(buf[:])
		} else if !errors.Is(err, os.ErrDeadlineExceeded) {
			return quiet(ctx, err)
		}
		n, err := readInt(usage)
		if err != nil { // the cgroup is gone (the kernel signals its removal too)
			return nil
		}
		switch {
		case n < threshold:
			reported = 0
		// Two crossings or more since the last look: it fell under and rose again.
		case reported == 0 || crossings >= 2 || n >= reported+v1Growth:
			above(n)
			// Growth is counted from after the reaction: what the process ended was still
			// allocating meanwhile, and its memory may take a moment to be given back.
			reported = n
			if m, err := readInt(usage); err == nil {
				reported = max(n, m)
			}
		}
	}
}

// ErrNoReclaimEvents is returned by Reclaim for a cgroup whose kernel interface has no
// reclaim notifications (cgroup v2, whose Memory watch counts the charges above
// memory.high instead).
var ErrNoReclaimEvents = errors.New("cgroupwatch: no reclaim notifications")

// CanReclaim reports (nil) whether Reclaim can watch the cgroup dir, else
// ErrNoReclaimEvents.
func CanReclaim(dir string) error {
	if !exists(filepath.Join(dir, "memory.pressure_level")) {
		return ErrNoReclaimEvents
	}
	return nil
}

// Reclaim calls reclaimed each time the kernel reclaims memory charged to the cgroup dir
// (cgroup v1: a vmpressure notification of level "low" or above, registered through
// cgroup.event_control on memory.pressure_level; the kernel sends one for every 512
// pages it scans in the cgroup), one call at a time, notifications that come meanwhile
// coalesced into one more. It returns when ctx is done or the cgroup is removed (nil),
// or at once: ErrNoReclaimEvents where the cgroup has no such notifications.
//
// A cgroup that file cache holds at its limit stays there while its processes grow
// into the cache: its usage does not move, so Memory's threshold says nothing, but
// every page the processes take is reclaimed from the cache first.
func Reclaim(ctx context.Context, dir string, reclaimed func()) error {
	level, err := os.Open(filepath.Join(dir, "memory.pressure_level"))
	if errors.Is(err, os.ErrNotExist) {
		return ErrNoReclaimEvents
	}
	if err != nil {
		return err
	}
	defer level.Close()
	events, err := register(dir, level, "low")
	if err != nil {
		return err
	}
	defer events.Close()
	stop := closeOnDone(ctx, events)
	defer stop()
	var buf [8]byte
	for {
		if _, err := io.ReadFull(events, buf[:]); err != nil {
			return quiet(ctx, err)
		}
		// The kernel signals the cgroup's removal too.
		if _, err := os.Stat(filepath.Join(dir, "memory.pressure_level")); err != nil {
			return nil
		}
		reclaimed()
	}
}

// register asks cgroup v1 to signal an eventfd on the events of the cgroup dir's file
// (cgroup.event_control: "<eventfd> <file> <args>") and returns the eventfd. It is
// non-blocking, so it goes to the runtime's poller: a Read waits without a thread, and
// Close ends it.
func register(dir string, file *os.File, args string) (*os.File, error) {
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("cgroupwatch: eventfd: %w", err)
	}
	events := os.NewFile(uintptr(efd), "eventfd")
	reg := fmt.Sprintf("%d %d %s", efd, file.Fd(), args)
	if err := os.WriteFile(filepath.Join(dir, "cgroup.event_control"), []byte(reg), 0); err != nil {
		events.Close()
		return nil, fmt.Errorf("cgroupwatch: register for events of %s: %w", file.Name(), err)
	}
	return events, nil
}

// v1Growth is how much usage that stays above the threshold must grow before cgroup v1
// reports it again.
const v1Growth = 4 << 20

// watchV2 sets memory.high and waits for memory.events to change (the kernel notifies
// a modification of it through inotify); a higher "high" count is a rise above it.
func watchV2(ctx context.Context, dir string, threshold int64, above func(int64)) error {
	ifd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return fmt.Errorf("cgroupwatch: inotify: %w", err)
	}
	notes := os.NewFile(uintptr(ifd), "inotify")
	defer notes.Close()
	eventsFile := filepath.Join(dir, "memory.events")
	if _, err := unix.InotifyAddWatch(ifd, eventsFile, unix.IN_MODIFY); err != nil {
		return fmt.Errorf("cgroupwatch: watch %s: %w", eventsFile, err)
	}
	high := filepath.Join(dir, "memory.high")
	if err := os.WriteFile(high, []byte(strconv.FormatInt(threshold, 10)), 0); err != nil {
		return fmt.Errorf("cgroupwatch: set %s: %w", high, err)
	}
	defer os.WriteFile(high, []byte("max"), 0) // gone with the cgroup: nothing to undo
	seen, err := highCount(eventsFile)
	if err != nil {
		return err
	}
	var last time.Time
	stop := closeOnDone(ctx, notes)
	defer stop()
	buf := make([]byte, 4096)
	for {
		if _, err := notes.Read(buf); err != nil {
			return quiet(ctx, err)
		}
		n, err := highCount(eventsFile)
		if err != nil { // the cgroup is gone
			return nil
		}
		if n <= seen || time.Since(last) < v2Quiet {
			continue
		}
		seen = n
		current, err := readFileInt(filepath.Join(dir, "memory.current"))
		if err != nil {
			return nil
		}
		if current < threshold {
			continue
		}
		above(current)
		last = time.Now()
		// Charges during the reaction (the process it ended was still allocating) are
		// not a rise after it.
		if n, err := highCount(eventsFile); err == nil {
			seen = max(seen, n)
		}
	}
}

// v2Quiet is the least time between two reports on cgroup v2. The kernel counts every
// charge above memory.high, not only a crossing, so usage that stays above it (memory
// the report's reaction did not free) keeps counting; one report a second, while the
// usage is above the threshold, stands for the crossings v1 reports.
const v2Quiet = time.Second

// highCount reads the "high" line of a memory.events file.
func highCount(file string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "high "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("cgroupwatch: no high count in %s", file)
}

// closeOnDone closes f when ctx is done; the returned function stops that and waits.
func closeOnDone(ctx context.Context, f *os.File) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		select {
		case <-ctx.Done():
			f.Close()
		case <-done:
		}
	})
	return func() { close(done); wg.Wait() }
}

// quiet turns the read error of a watch that ctx ended into nil.
func quiet(ctx context.Context, err error) error {
	if ctx.Err() != nil || errors.Is(err, os.ErrClosed) {
		return nil
	}
	return fmt.Errorf("cgroupwatch: %w", err)
}

func readInt(f *os.File) (int64, error) {
	var buf [32]byte
	n, err := f.ReadAt(buf[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(buf[:n])), 10, 64)
}

func readFileInt(file string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
}

func exists(f string) bool {
	_, err := os.Stat(f)
	return err == nil
}
