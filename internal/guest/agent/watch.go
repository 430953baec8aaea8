package agent

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// The watcher uses inotify directly rather than fsnotify: fsnotify has no recursive
// watches on Linux, hides IN_ISDIR (is_dir of a removed entry cannot be recovered by
// stat), and hides IN_Q_OVERFLOW behind an error; what is needed here is ~150 lines.

const watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_DELETE | unix.IN_DELETE_SELF |
	unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_MOVE_SELF | unix.IN_ATTRIB |
	unix.IN_ONLYDIR | unix.IN_DONT_FOLLOW

// watcher turns inotify events under root into WatchEvents on events. The channel is
// unbuffered: when the reader is slow, the kernel queue fills and reports an overflow,
// so memory stays bounded.
type watcher struct {
	f         *os.File
	raw       syscall.RawConn
	root      string
	recursive bool
	log       *slog.Logger
	wds       map[int32]string // only touched by newWatcher, then by the loop goroutine
	events    chan wire.WatchEvent
	stop      chan struct{}
	done      chan struct{}
}

func newWatcher(root string, recursive bool, log *slog.Logger) (*watcher, error) {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("inotify: %w", err)
	}
	// Non-blocking, so the file is served by the runtime poller and Close unblocks Read.
	f := os.NewFile(uintptr(fd), "inotify")
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("inotify: %w", err)
	}
	w := &watcher{
		f: f, raw: raw, root: root, recursive: recursive, log: log,
		wds:    make(map[int32]string),
		events: make(chan wire.WatchEvent),
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	if err := w.add(root); err != nil {
		f.Close()
		return nil, fmt.Errorf("watch %s: %w", root, err)
	}
	if recursive {
		w.addTree(root, false)
	}
	go w.loop()
	return w, nil
}

func (w *watcher) close() {
	close(w.stop)
	w.f.Close()
	<-w.done
}

func (w *watcher) add(dir string) error {
	var wd int
	var err error
	cerr := w.raw.Control(func(fd uintptr) {
		wd, err = unix.InotifyAddWatch(int(fd), dir, watchMask)
	})
	if cerr != nil {
		return cerr
	}
	if err != nil {
		return err
	}
	w.wds[int32(wd)] = dir
	return nil
}

// addTree watches every directory below dir (not dir itself). With emit, entries found
// are reported as created: they appeared before their directory's watch existed.
func (w *watcher) addTree(dir string, emit bool) {
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return nil
		}
		if emit && !w.send(w.event(wire.WatchCreate, p, d.IsDir())) {
			return filepath.SkipAll
		}
		if d.IsDir() {
			if err := w.add(p); err != nil {
				w.log.Debug("watch subdirectory", "path", p, "err", err)
				return filepath.SkipDir
			}
		}
		return nil
	})
}

// forget drops the watches of dir and everything below it (moved away).
func (w *watcher) forget(dir string) {
	prefix := dir + string(filepath.Separator)
	for wd, p := range w.wds {
		if p == dir || strings.HasPrefix(p, prefix) {
			_ = w.raw.Control(func(fd uintptr) { _, _ = unix.InotifyRmWatch(int(fd), uint32(wd)) })
			delete(w.wds, wd)
		}
	}
}

func (w *watcher) event(typ, path string, isDir bool) wire.WatchEvent {
	rel, err := filepath.Rel(w.root, path)
	if err != nil {
		rel = path
	}
	return wire.WatchEvent{Type: typ, Path: path, Name: rel, IsDir: isDir}
}

func (w *watcher) send(ev wire.WatchEvent) bool {
	select {
	case w.events <- ev:
		return true
	case <-w.stop:
		return false
	}
}

func (w *watcher) loop() {
	defer close(w.done)
	defer close(w.events)
	buf := make([]byte, 64<<10)
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				w.log.Debug("inotify read", "err", err)
			}
			return
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			wd := int32(binary.NativeEndian.Uint32(buf[off:]))
			mask := binary.NativeEndian.Uint32(buf[off+4:])
			nameLen := int(binary.NativeEndian.Uint32(buf[off+12:]))
			nameStart := off + unix.SizeofInotifyEvent
			name := strings.TrimRight(string(buf[nameStart:min(nameStart+nameLen, n)]), "\x00")
			off = nameStart + nameLen
			if !w.handle(wd, mask, name) {
				return
			}
		}
	}
}

// handle processes one inotify event; false ends the watch.
func (w *watcher) handle(wd int32, mask uint32, name string) bool {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		return w.send(wire.WatchEvent{Type: wire.WatchOverflow})
	}
	dir, ok := w.wds[wd]
	if mask&unix.IN_IGNORED != 0 {
		delete(w.wds, wd)
		return dir != w.root // the watched directory itself is gone
	}
	if !ok {
		return true
	}
	isDir := mask&unix.IN_ISDIR != 0
	if name == "" {
		// An event about a watched directory itself: only the root's end matters (its
		// parent is not watched, so nobody else reports it).
		if dir == w.root && mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 {
			typ := wire.WatchRemove
			if mask&unix.IN_MOVE_SELF != 0 {
				typ = wire.WatchRename
			}
			w.send(wire.WatchEvent{Type: typ, Path: w.root, Name: ".", IsDir: true})
			return false
		}
		return true
	}
	path := filepath.Join(dir, name)
	var typ string
	switch {
	case mask&unix.IN_CREATE != 0:
		typ = wire.WatchCreate
	case mask&unix.IN_MOVED_TO != 0:
		typ = wire.WatchCreate
	case mask&unix.IN_MODIFY != 0:
		typ = wire.WatchWrite
	case mask&unix.IN_DELETE != 0:
		typ = wire.WatchRemove
	case mask&unix.IN_MOVED_FROM != 0:
		typ = wire.WatchRename
	case mask&unix.IN_ATTRIB != 0:
		typ = wire.WatchChmod
	default:
		return true
	}
	if !w.send(w.event(typ, path, isDir)) {
		return false
	}
	if w.recursive && isDir {
		switch typ {
		case wire.WatchCreate:
			if err := w.add(path); err != nil {
				w.log.Debug("watch new directory", "path", path, "err", err)
				return true
			}
			w.addTree(path, true)
		case wire.WatchRename, wire.WatchRemove:
			w.forget(path)
		}
	}
	return true
}

func (a *Agent) handleWatch(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	_, path, err := a.resolve(q.Get("user"), q.Get("path"))
	if err != nil {
		return err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return &apiError{status: http.StatusBadRequest, code: wire.ErrCodeNotDir, msg: path + " is not a directory"}
	}
	wt, err := newWatcher(path, queryBool(r, "recursive"), a.log)
	if err != nil {
		return err
	}
	defer wt.close()
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	enc := json.NewEncoder(w)
	if enc.Encode(wire.WatchEvent{Type: wire.WatchStart, Path: path}) != nil || rc.Flush() != nil {
		return nil
	}
	hb := time.NewTimer(a.cfg.HeartbeatInterval)
	defer hb.Stop()
	for {
		select {
		case ev, ok := <-wt.events:
			if !ok {
				_ = rc.Flush()
				return nil
			}
			if enc.Encode(ev) != nil {
				return nil
			}
			// Send whatever else is ready in the same flush.
		batch:
			for range 256 {
				select {
				case ev, ok := <-wt.events:
					if !ok {
						break batch
					}
					if enc.Encode(ev) != nil {
						return nil
					}
				default:
					break batch
				}
			}
			if rc.Flush() != nil {
				return nil
			}
		case <-hb.C:
			if enc.Encode(wire.WatchEvent{Type: wire.WatchHeartbeat}) != nil || rc.Flush() != nil {
				return nil
			}
		case <-r.Context().Done():
			return nil
		}
		hb.Reset(a.cfg.HeartbeatInterval)
	}
}
