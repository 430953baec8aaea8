package agent_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/textproto"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/spacedev/space/internal/guest/agent"
	"github.com/spacedev/space/internal/guest/envdpb"
	filesystempb "github.com/spacedev/space/internal/guest/envdpb/filesystem"
	"github.com/spacedev/space/internal/guest/envdpb/filesystem/filesystempbconnect"
	processpb "github.com/spacedev/space/internal/guest/envdpb/process"
	"github.com/spacedev/space/internal/guest/envdpb/process/processpbconnect"
)

// envdEnv is an agent with envd clients: JSON (what the E2B SDKs speak) and binary
// protobuf.
type envdEnv struct {
	*testEnv
	http    *http.Client
	base    string
	proc    processpbconnect.ProcessClient
	procBin processpbconnect.ProcessClient
	fs      filesystempbconnect.FilesystemClient
}

func startEnvd(t *testing.T) *envdEnv { return startEnvdWith(t, nil) }

func startEnvdWith(t *testing.T, mod func(*agent.Config)) *envdEnv {
	env := startAgent(t, mod)
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", env.sock)
	}}
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr}
	base := "http://agent" + agent.EnvdPrefix
	return &envdEnv{
		testEnv: env, http: hc, base: base,
		proc:    processpbconnect.NewProcessClient(hc, base, connect.WithProtoJSON()),
		procBin: processpbconnect.NewProcessClient(hc, base),
		fs:      filesystempbconnect.NewFilesystemClient(hc, base, connect.WithProtoJSON()),
	}
}

// asUser names the envd user with Basic auth, as the SDKs do.
func asUser[T any](req *connect.Request[T], user string) *connect.Request[T] {
	req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	return req
}

// procResult is what a Start or Connect stream delivered.
type procResult struct {
	pid        uint32
	stdout     string
	stderr     string
	pty        string
	keepalives int
	end        *processpb.ProcessEvent_EndEvent
	err        error
}

// procStream is a Start or Connect stream.
type procStream[T interface {
	GetEvent() *processpb.ProcessEvent
}] interface {
	Receive() bool
	Msg() T
	Err() error
}

func drain[T interface {
	GetEvent() *processpb.ProcessEvent
}](s procStream[T]) procResult {
	var r procResult
	for s.Receive() {
		switch ev := s.Msg().GetEvent().GetEvent().(type) {
		case *processpb.ProcessEvent_Start:
			r.pid = ev.Start.GetPid()
		case *processpb.ProcessEvent_Data:
			r.stdout += string(ev.Data.GetStdout())
			r.stderr += string(ev.Data.GetStderr())
			r.pty += string(ev.Data.GetPty())
		case *processpb.ProcessEvent_Keepalive:
			r.keepalives++
		case *processpb.ProcessEvent_End:
			r.end = ev.End
		}
	}
	r.err = s.Err()
	return r
}

func bash(cmd string) *processpb.ProcessConfig {
	return &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", cmd}}
}

func codeOf(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	return connect.CodeUnknown
}

func TestEnvdProcessRun(t *testing.T) {
	e := startEnvd(t)
	ctx := testCtx(t, time.Minute)
	no := false
	for name, c := range map[string]processpbconnect.ProcessClient{"json": e.proc, "binary": e.procBin} {
		st, err := c.Start(ctx, connect.NewRequest(&processpb.StartRequest{
			Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", `echo "out $A $USER"; echo err >&2; pwd; exit 3`}, Envs: map[string]string{"A": "1"}},
			Stdin:   &no,
		}))
		if err != nil {
			t.Fatal(err)
		}
		r := drain(st)
		if r.err != nil || r.pid == 0 || r.end == nil {
			t.Fatalf("%s: %+v", name, r)
		}
		want := "out 1 user\n" + e.home + "\n"
		if r.stdout != want || r.stderr != "err\n" {
			t.Errorf("%s: stdout %q stderr %q, want %q", name, r.stdout, r.stderr, want)
		}
		if r.end.GetExitCode() != 3 || !r.end.GetExited() || r.end.GetStatus() != "exit status 3" || r.end.GetError() != "exit status 3" {
			t.Errorf("%s: end %+v", name, r.end)
		}
	}

	// A missing cwd is an invalid argument; root is named with Basic auth.
	st, err := e.proc.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/true", Cwd: new("/nonexistent")}}))
	if err == nil {
		r := drain(st)
		err = r.err
	}
	if codeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("missing cwd: %v", err)
	}
	st, err = e.proc.Start(ctx, asUser(connect.NewRequest(&processpb.StartRequest{Process: bash("id -un; pwd")}), "root"))
	if err != nil {
		t.Fatal(err)
	}
	if r := drain(st); r.stdout != "root\n/root\n" && r.stdout != "root\n/\n" {
		t.Errorf("as root: %+v", r)
	}
	st, err = e.proc.Start(ctx, asUser(connect.NewRequest(&processpb.StartRequest{Process: bash("true")}), "nobody-here"))
	if err == nil {
		err = drain(st).err
	}
	if codeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("unknown user: %v", err)
	}
}

func TestEnvdProcessBackground(t *testing.T) {
	e := startEnvd(t)
	ctx := testCtx(t, time.Minute)
	yes := true
	// A background process with stdin: the first stream goes away, Connect
	// re-attaches, stdin goes in, CloseStdin ends it.
	sctx, cancel := context.WithCancel(ctx)
	st, err := e.proc.Start(sctx, connect.NewRequest(&processpb.StartRequest{Process: bash("echo ready; cat; echo done"), Stdin: &yes, Tag: new("cat")}))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	for st.Receive() && string(st.Msg().GetEvent().GetData().GetStdout()) != "ready\n" {
	}
	cancel()
	drain(st)

	list, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Msg.Processes) != 1 || list.Msg.Processes[0].GetPid() != pid || list.Msg.Processes[0].GetTag() != "cat" ||
		list.Msg.Processes[0].GetConfig().GetCmd() != "/bin/sh" {
		t.Fatalf("list: %v", list.Msg)
	}
	cs, err := e.proc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "cat"}}}))
	if err != nil {
		t.Fatal(err)
	}
	if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
		t.Fatalf("connect start: %v %v", cs.Msg(), cs.Err())
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("hello\n")}}})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte("x")}}})); codeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("pty input to a pipe process: %v", err)
	}
	if _, err := e.proc.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r := drain(cs)
	// Connect sends live output only: "ready" came before it.
	if r.err != nil || r.stdout != "hello\ndone\n" || r.end.GetExitCode() != 0 || r.end.Error != nil {
		t.Fatalf("connect: %+v", r)
	}
	// An exited process: Connect replays start and end; signals and input are
	// not found (the SDK's kill() then returns false).
	cs, err = e.proc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: sel}))
	if err != nil {
		t.Fatal(err)
	}
	if r := drain(cs); r.pid != pid || r.end == nil || r.stdout != "" {
		t.Errorf("connect after exit: %+v", r)
	}
	if _, err := e.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL})); codeOf(err) != connect.CodeNotFound {
		t.Errorf("kill exited: %v", err)
	}

	// Kill, keepalives, and Connect-Timeout-Ms as the process's lifetime.
	h := connect.NewRequest(&processpb.StartRequest{Process: bash("sleep 30")})
	h.Header().Set("Keepalive-Ping-Interval", "1")
	st, err = e.proc.Start(ctx, h)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	sel = &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: st.Msg().GetEvent().GetStart().GetPid()}}
	for st.Receive() && st.Msg().GetEvent().GetKeepalive() == nil {
	}
	if _, err := e.proc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	r = drain(st)
	if r.end.GetExitCode() != -1 || r.end.GetExited() || r.end.GetStatus() != "signal: killed" {
		t.Errorf("killed: %+v", r.end)
	}
	tctx, tcancel := context.WithTimeout(ctx, 700*time.Millisecond)
	defer tcancel()
	st, err = e.proc.Start(tctx, connect.NewRequest(&processpb.StartRequest{Process: bash("sleep 30")}))
	if err != nil {
		t.Fatal(err)
	}
	r = drain(st)
	if codeOf(r.err) != connect.CodeDeadlineExceeded && codeOf(r.err) != connect.CodeCanceled {
		t.Errorf("timeout: %+v", r)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		list, err := e.proc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Msg.Processes) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("process outlived its Connect-Timeout-Ms: %v", list.Msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestEnvdPTY(t *testing.T) {
	e := startEnvd(t)
	ctx := testCtx(t, time.Minute)
	st, err := e.proc.Start(ctx, connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-i"}, Envs: map[string]string{"PS1": "$ "}},
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Cols: 80, Rows: 24}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: st.Msg().GetEvent().GetStart().GetPid()}}
	if _, err := e.proc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{Process: sel, Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 100, Rows: 30}}})); err != nil {
		t.Fatal(err)
	}
	// Before the input that ends it: a shell that exited first is not found.
	if _, err := e.proc.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); codeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("close stdin of a pty: %v", err)
	}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte("stty size; exit 7\n")}}})); err != nil {
		t.Fatal(err)
	}
	r := drain(st)
	if !strings.Contains(r.pty, "30 100") || r.stdout != "" || r.end.GetExitCode() != 7 {
		t.Fatalf("pty: %+v", r)
	}
}

// envdHTTP sends a plain HTTP request to envd.
func (e *envdEnv) envdHTTP(t *testing.T, method, path string, body io.Reader, hdr map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, e.base+path, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.http.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func TestEnvdFiles(t *testing.T) {
	e := startEnvd(t)
	ctx := testCtx(t, time.Minute)

	// Multipart upload of two files, full target paths in the filenames.
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	for name, content := range map[string]string{filepath.Join(e.home, "a/b/one.txt"): "one", "rel/two.txt": "two"} {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", `form-data; name="file"; filename="`+name+`"`)
		pw, _ := mw.CreatePart(h)
		pw.Write([]byte(content))
	}
	mw.Close()
	resp, b := e.envdHTTP(t, "POST", "/files", &body, map[string]string{"Content-Type": mw.FormDataContentType()})
	var infos []map[string]any
	if resp.StatusCode != 200 || json.Unmarshal(b, &infos) != nil || len(infos) != 2 {
		t.Fatalf("upload: %d %s", resp.StatusCode, b)
	}
	for _, p := range []string{"a/b/one.txt", "rel/two.txt"} {
		fi, err := os.Stat(filepath.Join(e.home, p))
		if err != nil {
			t.Fatal(err)
		}
		if uid := statUID(fi); os.Geteuid() == 0 && uid != 4242 {
			t.Errorf("%s owned by %d, want the default user", p, uid)
		}
	}
	// Raw gzip upload with metadata, then gzip and plain downloads.
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte("zipped"))
	zw.Close()
	resp, b = e.envdHTTP(t, "POST", "/files?path=z.txt", &gz, map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip", "X-Metadata-Owner": "me"})
	if resp.StatusCode != 200 && !strings.Contains(string(b), "not supported") {
		t.Fatalf("octet upload: %d %s", resp.StatusCode, b)
	}
	metadataOK := resp.StatusCode == 200
	if !metadataOK {
		t.Logf("file metadata unsupported here: %s", b)
		resp, b = e.envdHTTP(t, "POST", "/files?path=z.txt", bytes.NewReader([]byte("zipped")), map[string]string{"Content-Type": "application/octet-stream"})
		if resp.StatusCode != 200 {
			t.Fatalf("octet upload: %d %s", resp.StatusCode, b)
		}
	}
	resp, b = e.envdHTTP(t, "GET", "/files?path=z.txt", nil, map[string]string{"Accept-Encoding": "identity"})
	if resp.StatusCode != 200 || string(b) != "zipped" || resp.Header.Get("Content-Length") != "6" {
		t.Fatalf("download: %d %q %v", resp.StatusCode, b, resp.Header)
	}
	resp, b = e.envdHTTP(t, "GET", "/files?path="+filepath.Join(e.home, "z.txt"), nil, map[string]string{envdpb.AcceptEncodingHeader: "gzip", "Accept-Encoding": "gzip"})
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("gzip download: %v", resp.Header)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := io.ReadAll(zr); string(got) != "zipped" {
		t.Errorf("gzip download: %q", got)
	}
	for path, status := range map[string]int{"/files?path=missing": 404, "/files?path=a": 400, "/files?path=x&username=nobody-here": 401} {
		resp, b = e.envdHTTP(t, "GET", path, nil, nil)
		var eb struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if resp.StatusCode != status || json.Unmarshal(b, &eb) != nil || eb.Code != status || eb.Message == "" {
			t.Errorf("GET %s: %d %s, want %d", path, resp.StatusCode, b, status)
		}
	}
	// The gateway's status tunnel.
	resp, _ = e.envdHTTP(t, "GET", "/files?path=missing", nil, map[string]string{envdpb.TunnelHeader: "1"})
	if resp.StatusCode != 200 || resp.Header.Get(envdpb.StatusHeader) != "404" {
		t.Errorf("tunnel: %d %v", resp.StatusCode, resp.Header)
	}
	if resp, _ := e.envdHTTP(t, "GET", "/health", nil, nil); resp.StatusCode != 204 {
		t.Errorf("health: %d", resp.StatusCode)
	}
	resp, b = e.envdHTTP(t, "GET", "/metrics", nil, nil)
	var m struct {
		CPUCount  int   `json:"cpu_count"`
		MemTotal  int64 `json:"mem_total"`
		DiskTotal int64 `json:"disk_total"`
	}
	if resp.StatusCode != 200 || json.Unmarshal(b, &m) != nil || m.CPUCount < 1 || m.MemTotal <= 0 || m.DiskTotal <= 0 {
		t.Errorf("metrics: %d %s", resp.StatusCode, b)
	}
	if resp, b := e.envdHTTP(t, "GET", "/envs", nil, nil); resp.StatusCode != 200 || !json.Valid(b) {
		t.Errorf("envs: %d %s", resp.StatusCode, b)
	}

	// The filesystem service.
	st, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "z.txt"}))
	if err != nil {
		t.Fatal(err)
	}
	if en := st.Msg.GetEntry(); en.GetType() != filesystempb.FileType_FILE_TYPE_FILE || en.GetSize() != 6 || en.GetPath() != filepath.Join(e.home, "z.txt") ||
		en.GetPermissions() != "-rw-r--r--" || (metadataOK && en.GetMetadata()["owner"] != "me") {
		t.Errorf("stat: %v", en)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: "nope"})); codeOf(err) != connect.CodeNotFound {
		t.Errorf("stat missing: %v", err)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: "d1/d2"})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: "d1/d2"})); codeOf(err) != connect.CodeAlreadyExists {
		t.Errorf("mkdir again: %v", err)
	}
	ls, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "a", Depth: 2}))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, en := range ls.Msg.GetEntries() {
		names = append(names, strings.TrimPrefix(en.GetPath(), e.home+"/"))
	}
	if !slices.Equal(names, []string{"a/b", "a/b/one.txt"}) {
		t.Errorf("list depth 2: %v", names)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: "z.txt"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("list a file: %v", err)
	}
	mv, err := e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "z.txt", Destination: "d1/z2.txt"}))
	if err != nil || mv.Msg.GetEntry().GetName() != "z2.txt" {
		t.Fatalf("move: %v %v", mv, err)
	}
	if _, err := e.fs.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: "z.txt", Destination: "x"})); codeOf(err) != connect.CodeNotFound {
		t.Errorf("move missing: %v", err)
	}
	if _, err := e.fs.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: "d1"})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.home, "d1")); !os.IsNotExist(err) {
		t.Errorf("removed dir still there: %v", err)
	}
}

func TestEnvdWatch(t *testing.T) {
	e := startEnvd(t)
	ctx := testCtx(t, time.Minute)
	dir := filepath.Join(e.home, "w")
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	ws, err := e.fs.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: "w", Recursive: true, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	if !ws.Receive() || ws.Msg().GetStart() == nil {
		t.Fatalf("first event: %v %v", ws.Msg(), ws.Err())
	}
	if err := os.WriteFile(filepath.Join(dir, "sub/f.txt"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for ws.Receive() {
		ev := ws.Msg().GetFilesystem()
		if ev != nil && ev.GetName() == "sub/f.txt" && ev.GetType() == filesystempb.EventType_EVENT_TYPE_CREATE {
			if ev.GetEntry().GetType() != filesystempb.FileType_FILE_TYPE_FILE {
				t.Errorf("entry: %v", ev.GetEntry())
			}
			break
		}
	}
	ws.Close()

	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.GetWatcherId()
	if err := os.WriteFile(filepath.Join(dir, "g.txt"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for found := false; !found; {
		evs, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs.Msg.GetEvents() {
			found = found || ev.GetName() == "g.txt"
		}
		if time.Now().After(deadline) {
			t.Fatal("no event for g.txt")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Errorf("removed watcher: %v", err)
	}
}

func statUID(fi os.FileInfo) uint32 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Uid
	}
	return 0
}

// envd streams have no gap event: a byte that fell out of the journal would be lost
// without a word. A reader that keeps up, however slowly, gets every byte.
func TestEnvdSlowReaderLosesNothing(t *testing.T) {
	e := startEnvdWith(t, func(c *agent.Config) { c.JournalBytes = 256 << 10 })
	ctx := testCtx(t, time.Minute)
	const total = 8 << 20
	st, err := e.procBin.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: bash("head -c 8388608 /dev/zero")}))
	if err != nil {
		t.Fatal(err)
	}
	var got, events int
	var end *processpb.ProcessEvent_EndEvent
	for st.Receive() {
		switch ev := st.Msg().GetEvent().GetEvent().(type) {
		case *processpb.ProcessEvent_Data:
			got += len(ev.Data.GetStdout())
			events++
			time.Sleep(2 * time.Millisecond) // slower than head
		case *processpb.ProcessEvent_End:
			end = ev.End
		}
	}
	if err := st.Err(); err != nil || end == nil || end.GetExitCode() != 0 {
		t.Fatalf("stream: end %v, err %v", end, err)
	}
	if got != total {
		t.Fatalf("received %d bytes in %d events, want %d", got, events, total)
	}
}
