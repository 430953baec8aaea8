package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	filesystempb "github.com/spacedev/space/internal/guest/envdpb/filesystem"
	"github.com/spacedev/space/internal/guest/wire"
)

// envdFilesystem implements envd's filesystem.Filesystem. Paths are absolute, or
// relative to the home of the request's user ("~" expands to it).
type envdFilesystem struct {
	e *envd
}

func (s *envdFilesystem) resolve(h http.Header, p string) (account, string, error) {
	name, err := basicUser(h)
	if err != nil {
		return account{}, "", err
	}
	acct, err := s.e.account(name)
	if err != nil {
		return account{}, "", connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid user %q: %w", name, err))
	}
	abs, err := resolvePath(acct, p)
	if err != nil {
		return account{}, "", rpcError(err)
	}
	return acct, abs, nil
}

// entry describes path in envd's form: lstat, except that a symbolic link reports
// its resolved absolute target (its own path when it does not resolve) and the
// target's type and permission bits, as envd does. Permissions are rendered like Go's
// fs.FileMode (envd's format: "Lrwxrwxrwx" for a link).
func (e *envd) entry(path string, names *nameCache) (*filesystempb.EntryInfo, error) {
	info, fi, err := e.a.entryInfoFI(path, names)
	if err != nil {
		return nil, err
	}
	out := &filesystempb.EntryInfo{
		Name:         info.Name,
		Path:         info.Path,
		Size:         info.Size,
		Mode:         info.Mode,
		Permissions:  fi.Mode().String(),
		Owner:        info.Owner,
		Group:        info.Group,
		ModifiedTime: timestamppb.New(info.ModifiedTime),
	}
	mdPath, mdInfo := path, fi
	switch info.Type {
	case wire.FileTypeFile:
		out.Type = filesystempb.FileType_FILE_TYPE_FILE
	case wire.FileTypeDir:
		out.Type = filesystempb.FileType_FILE_TYPE_DIRECTORY
	case wire.FileTypeSymlink:
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			target = path
		}
		out.SymlinkTarget = &target
		out.Type, out.Mode = filesystempb.FileType_FILE_TYPE_UNSPECIFIED, 0
		if target != path {
			if ti, err := os.Stat(target); err == nil {
				switch {
				case ti.Mode().IsRegular():
					out.Type = filesystempb.FileType_FILE_TYPE_FILE
				case ti.IsDir():
					out.Type = filesystempb.FileType_FILE_TYPE_DIRECTORY
				}
				out.Mode = uint32(ti.Mode().Perm())
				// Uploads through a link write the target, metadata included.
				mdPath, mdInfo = target, ti
			}
		}
	}
	out.Metadata = e.a.meta.get(mdPath, mdInfo)
	return out, nil
}

func (s *envdFilesystem) Stat(ctx context.Context, req *connect.Request[filesystempb.StatRequest]) (*connect.Response[filesystempb.StatResponse], error) {
	_, path, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	entry, err := s.e.entry(path, nil)
	if err != nil {
		return nil, rpcError(err)
	}
	return connect.NewResponse(&filesystempb.StatResponse{Entry: entry}), nil
}

func (s *envdFilesystem) MakeDir(ctx context.Context, req *connect.Request[filesystempb.MakeDirRequest]) (*connect.Response[filesystempb.MakeDirResponse], error) {
	acct, path, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(path); err == nil {
		if fi.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %s already exists", path))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s exists and is not a directory", path))
	}
	if err := ensureDirs(path, acct); err != nil {
		return nil, rpcError(err)
	}
	entry, err := s.e.entry(path, nil)
	if err != nil {
		return nil, rpcError(err)
	}
	return connect.NewResponse(&filesystempb.MakeDirResponse{Entry: entry}), nil
}

func (s *envdFilesystem) Move(ctx context.Context, req *connect.Request[filesystempb.MoveRequest]) (*connect.Response[filesystempb.MoveResponse], error) {
	acct, from, err := s.resolve(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	_, to, err := s.resolve(req.Header(), req.Msg.GetDestination())
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(from); err != nil {
		return nil, rpcError(err)
	}
	if err := ensureDirs(filepath.Dir(to), acct); err != nil {
		return nil, rpcError(err)
	}
	if err := s.e.a.rename(from, to); err != nil {
		return nil, rpcError(err)
	}
	entry, err := s.e.entry(to, nil)
	if err != nil {
		return nil, rpcError(err)
	}
	return connect.NewResponse(&filesystempb.MoveResponse{Entry: entry}), nil
}

func (s *envdFilesystem) ListDir(ctx context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	_, path, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	if depth > maxListDepth {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("depth must be at most %d", maxListDepth))
	}
	fi, err := os.Stat(path) // the directory itself may be a link to one
	if err != nil {
		return nil, rpcError(err)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", path))
	}
	names := newNameCache(s.e.a.users)
	out := &filesystempb.ListDirResponse{Entries: []*filesystempb.EntryInfo{}}
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, de := range entries {
			p := filepath.Join(dir, de.Name())
			entry, err := s.e.entry(p, names)
			if err != nil {
				continue // removed meanwhile
			}
			out.Entries = append(out.Entries, entry)
			if de.IsDir() && level < depth {
				_ = walk(p, level+1) // unreadable subdirectories are listed, not entered
			}
		}
		return nil
	}
	if err := walk(path, 1); err != nil {
		return nil, rpcError(err)
	}
	return connect.NewResponse(out), nil
}

func (s *envdFilesystem) Remove(ctx context.Context, req *connect.Request[filesystempb.RemoveRequest]) (*connect.Response[filesystempb.RemoveResponse], error) {
	_, path, err := s.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if path == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	if err := os.RemoveAll(path); err != nil {
		return nil, rpcError(err)
	}
	s.e.a.forgetMetadata(path)
	return connect.NewResponse(&filesystempb.RemoveResponse{}), nil
}

// openWatch starts an inotify watcher on a directory.
func (s *envdFilesystem) openWatch(h http.Header, p string, recursive bool) (*watcher, error) {
	_, path, err := s.resolve(h, p)
	if err != nil {
		return nil, err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, rpcError(err)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", path))
	}
	w, err := newWatcher(path, recursive, s.e.a.log)
	if err != nil {
		return nil, rpcError(err)
	}
	return w, nil
}

// fsEvent converts a watcher event; ok is false for events envd does not report.
func (e *envd) fsEvent(ev wire.WatchEvent, includeEntry bool) (*filesystempb.FilesystemEvent, bool) {
	var t filesystempb.EventType
	switch ev.Type {
	case wire.WatchCreate:
		t = filesystempb.EventType_EVENT_TYPE_CREATE
	case wire.WatchWrite:
		t = filesystempb.EventType_EVENT_TYPE_WRITE
	case wire.WatchRemove:
		t = filesystempb.EventType_EVENT_TYPE_REMOVE
	case wire.WatchRename:
		t = filesystempb.EventType_EVENT_TYPE_RENAME
	case wire.WatchChmod:
		t = filesystempb.EventType_EVENT_TYPE_CHMOD
	default:
		return nil, false
	}
	out := &filesystempb.FilesystemEvent{Name: ev.Name, Type: t}
	if includeEntry && t != filesystempb.EventType_EVENT_TYPE_REMOVE && t != filesystempb.EventType_EVENT_TYPE_RENAME {
		if entry, err := e.entry(ev.Path, nil); err == nil {
			out.Entry = entry
		}
	}
	return out, true
}

func (s *envdFilesystem) WatchDir(ctx context.Context, req *connect.Request[filesystempb.WatchDirRequest], stream *connect.ServerStream[filesystempb.WatchDirResponse]) error {
	w, err := s.openWatch(req.Header(), req.Msg.GetPath(), req.Msg.GetRecursive())
	if err != nil {
		return err
	}
	defer w.close()
	if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Start{Start: &filesystempb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	interval := keepaliveInterval(req.Header())
	ka := time.NewTimer(interval)
	defer ka.Stop()
	for {
		select {
		case ev, ok := <-w.events:
			if !ok {
				return nil // the directory itself is gone
			}
			fe, ok := s.e.fsEvent(ev, req.Msg.GetIncludeEntry())
			if !ok {
				continue
			}
			if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Filesystem{Filesystem: fe}}); err != nil {
				return err
			}
		case <-ka.C:
			if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Keepalive{Keepalive: &filesystempb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, errors.New("watch timeout reached"))
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		}
		ka.Reset(interval)
	}
}

// polledWatcher is a watcher whose events are queued for GetWatcherEvents. One that
// nobody polls for polledWatcherIdle is removed.
type polledWatcher struct {
	w            *watcher
	includeEntry bool
	stop         chan struct{}
	done         chan struct{}
	events       []*filesystempb.FilesystemEvent // guarded by envd.mu
	lastPoll     time.Time                       // guarded by envd.mu
}

const (
	polledWatcherMaxEvents = 10000
	polledWatcherIdle      = 10 * time.Minute
)

func (s *envdFilesystem) CreateWatcher(ctx context.Context, req *connect.Request[filesystempb.CreateWatcherRequest]) (*connect.Response[filesystempb.CreateWatcherResponse], error) {
	w, err := s.openWatch(req.Header(), req.Msg.GetPath(), req.Msg.GetRecursive())
	if err != nil {
		return nil, err
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	pw := &polledWatcher{w: w, includeEntry: req.Msg.GetIncludeEntry(), stop: make(chan struct{}), done: make(chan struct{}), lastPoll: time.Now()}
	e := s.e
	e.mu.Lock()
	e.watchers[id] = pw
	e.mu.Unlock()
	go e.collect(id, pw)
	return connect.NewResponse(&filesystempb.CreateWatcherResponse{WatcherId: id}), nil
}

// collect queues a polled watcher's events until it is removed or idle too long.
func (e *envd) collect(id string, pw *polledWatcher) {
	defer close(pw.done)
	defer pw.w.close()
	idle := time.NewTicker(time.Minute)
	defer idle.Stop()
	events := pw.w.events
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				events = nil // the directory is gone; the queue stays readable
				continue
			}
			fe, ok := e.fsEvent(ev, pw.includeEntry)
			if !ok {
				continue
			}
			e.mu.Lock()
			if len(pw.events) < polledWatcherMaxEvents {
				pw.events = append(pw.events, fe)
			}
			e.mu.Unlock()
		case <-idle.C:
			e.mu.Lock()
			stale := time.Since(pw.lastPoll) > polledWatcherIdle
			if stale && e.watchers[id] == pw {
				delete(e.watchers, id)
			}
			e.mu.Unlock()
			if stale {
				return
			}
		case <-pw.stop:
			return
		}
	}
}

func (s *envdFilesystem) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystempb.GetWatcherEventsRequest]) (*connect.Response[filesystempb.GetWatcherEventsResponse], error) {
	e := s.e
	e.mu.Lock()
	defer e.mu.Unlock()
	pw := e.watchers[req.Msg.GetWatcherId()]
	if pw == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", req.Msg.GetWatcherId()))
	}
	out := &filesystempb.GetWatcherEventsResponse{Events: pw.events}
	if out.Events == nil {
		out.Events = []*filesystempb.FilesystemEvent{}
	}
	pw.events = nil
	pw.lastPoll = time.Now()
	return connect.NewResponse(out), nil
}

func (s *envdFilesystem) RemoveWatcher(ctx context.Context, req *connect.Request[filesystempb.RemoveWatcherRequest]) (*connect.Response[filesystempb.RemoveWatcherResponse], error) {
	e := s.e
	e.mu.Lock()
	pw := e.watchers[req.Msg.GetWatcherId()]
	delete(e.watchers, req.Msg.GetWatcherId())
	e.mu.Unlock()
	if pw == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", req.Msg.GetWatcherId()))
	}
	close(pw.stop)
	<-pw.done
	return connect.NewResponse(&filesystempb.RemoveWatcherResponse{}), nil
}
