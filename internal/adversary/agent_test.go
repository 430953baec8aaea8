package adversary

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/e2e/e2etest"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

// impostorScript double-forks into a new session (out of every process group the agent
// knows) and, until its deadline, tries to take the agent's place: it connects to the
// node's socket (/run/space/node.sock) and asks for the control connection as the agent
// does (package agentlink). The node closes every such connection unanswered while the
// agent's own answers its pings; an impostor that ran while the agent was not connected (a restored sandbox
// whose agent waits for its identity) could be taken in its place. It logs every change
// of outcome and a heartbeat every 50 ms; if the node ever acknowledges it, it logs
// ACCEPTED (the node sent it a key) and holds the connection.
const impostorScript = `
import errno, os, socket, sys, time
path, logf, deadline = '/run/space/node.sock', sys.argv[1], time.time() + float(sys.argv[2])
if os.fork(): sys.exit(0)
os.setsid()
if os.fork(): os._exit(0)
nul = os.open('/dev/null', os.O_RDWR)
for fd in (0, 1, 2): os.dup2(nul, fd)
log = open(logf, 'a', buffering=1)
log.write('start pid %d sid %d pgid %d\n' % (os.getpid(), os.getsid(0), os.getpgid(0)))
open(logf + '.pid', 'w').write(str(os.getpid()))
def attempt(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(path)
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__, None
    try:
        s.sendall(b'space-agent control\n')
        buf = b''
        while b'\n' not in buf:
            chunk = s.recv(4096)
            if not chunk: break
            buf += chunk
        if buf.startswith(b'key '):
            return 'ACCEPTED', s
    except OSError:
        pass
    s.close()
    return 'REFUSED', None
last, tries, beat = None, 0, 0
while time.time() < deadline:
    tries += 1
    what, conn = attempt(tries)
    if conn is not None:
        log.write('%.3f ACCEPTED\n' % time.time())
        time.sleep(max(0, deadline - time.time()))
        break
    now = time.time()
    if what != last or now - beat > 0.05:
        log.write('%.3f try %d %s\n' % (now, tries, what))
        last, beat = what, now
    time.sleep(0.0005)
log.write('%.3f end after %d tries\n' % (time.time(), tries))
`

// raw sends one API request (as the admin key) and returns its status, the first 4 KiB
// of its body and how long the whole answer took (bodies are read to their end, at
// most 2 minutes).
func (su *suite) raw(method, path, body string) (int, string, time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, su.s.URL+path, strings.NewReader(body))
	if err != nil {
		return 0, err.Error(), 0
	}
	req.Header.Set("Authorization", "Bearer "+su.s.Key)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	t0 := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error(), time.Since(t0)
	}
	defer resp.Body.Close()
	head, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	_, err = io.Copy(io.Discard, resp.Body)
	took := time.Since(t0)
	if err != nil {
		return resp.StatusCode, string(head) + " (body: " + err.Error() + ")", took
	}
	return resp.StatusCode, strings.TrimSpace(string(head)), took
}

// attachGarbage creates a session in sandbox id and attaches to it: the stream must
// end with an error event (the agent sent garbage frames), reported as a 502.
func (su *suite) attachGarbage(id string) (r struct {
	what   string
	status int
	took   time.Duration
	body   string
}) {
	r.what = "attach to a session (garbage frames)"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	defer func() { r.took = time.Since(t0) }()
	sess, err := su.s.C.CreateSession(ctx, id, api.CreateSessionRequest{Argv: []string{"true"}})
	if err != nil {
		r.status, r.body = statusOf(err), err.Error()
		return r
	}
	st, err := su.s.C.Attach(ctx, sess, "")
	if err != nil {
		r.status, r.body = statusOf(err), err.Error()
		return r
	}
	defer st.Close()
	for {
		ev, err := st.Next()
		if err != nil {
			r.body = "stream ended without an error event: " + err.Error()
			return r
		}
		switch ev.Name {
		case api.EventError, api.EventLost:
			r.status, r.body = http.StatusBadGateway, ev.Name+" event: "+string(ev.Data)
			return r
		case api.EventExit:
			r.body = "exit event: " + string(ev.Data)
			return r
		}
	}
}

// agentHealth asks the agent of sandbox id for its health as the control plane does:
// through its node's data plane (/internal/v1/sandboxes/{id}/agent/…) with a node
// token minted from the server's signing key, so over the node's link to the agent.
func (su *suite) agentHealth(t *testing.T, id string) wire.Health {
	t.Helper()
	ctx := e2etest.Ctx(t, time.Minute)
	st, err := store.Open(ctx, store.Config{URL: su.s.DBURL, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	key, err := st.SigningKey(ctx, "attach-v1")
	if err != nil {
		t.Fatal(err)
	}
	signer, err := token.NewSigner(key)
	if err != nil {
		t.Fatal(err)
	}
	epoch, nodeID, err := st.TokenEpoch(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	node, err := st.GetNode(ctx, nodeID)
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := signer.Mint(token.Claims{Sandbox: id, Rights: []string{token.RightNode}, Epoch: epoch}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(ctx, "GET", node.DataPlaneURL+"/internal/v1/sandboxes/"+id+"/agent/v1/health", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("health of %s: %v", id, err)
	}
	defer resp.Body.Close()
	var h wire.Health
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&h); err != nil {
		t.Fatalf("health of %s (%d): %v", id, resp.StatusCode, err)
	}
	return h
}

// checkAgentIsReal checks that the host talks to the real agent of sandbox id after a
// restore made between from and to: the identity generation it reports is one the node
// made in that window (the node's generations are its clock in nanoseconds), the files
// API returns the real file, and the impostor's log shows the node never accepted it
// and kept refusing it after the sandbox was thawed.
func (su *suite) checkAgentIsReal(t *testing.T, id, marker string, from, to time.Time) {
	t.Helper()
	h := su.agentHealth(t, id)
	if h.Frozen || h.Generation < from.UnixNano() || h.Generation > to.UnixNano() {
		t.Errorf("%s: agent reports generation %d (frozen %v), not one the node made between %v and %v",
			id, h.Generation, h.Frozen, from.Format(time.StampMicro), to.Format(time.StampMicro))
	}
	rc, err := su.s.C.ReadFile(e2etest.Ctx(t, time.Minute), id, "/root/marker", client.FileOptions{})
	if err != nil {
		t.Fatalf("%s: read the marker: %v", id, err)
	}
	got, _ := io.ReadAll(io.LimitReader(rc, 1<<16))
	rc.Close()
	if string(got) != marker {
		t.Errorf("%s: the files API returned %q, want the real file %q", id, got, marker)
	}
	// The impostor ran again after the thaw and was still refused.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		log := su.mustSh(t, id, "cat /tmp/impostor.log")
		if strings.Contains(log, "ACCEPTED") {
			t.Fatalf("%s: the node took the impostor for the agent (wake or clone done at %.3f):\n%s", id, float64(to.UnixNano())/1e9, log)
		}
		if strings.Count(log, "REFUSED") > 1 && lastTry(log) > float64(to.UnixNano())/1e9 {
			break
		}
		if time.Now().After(deadline) {
			// What the impostor's process looks like, and the sandbox's clock against
			// the host's, to tell a process that never ran again from a clock behind.
			diag, _ := su.sh(t, id, `p=$(cat /tmp/impostor.log.pid); tail -3 /tmp/impostor.log; `+
				`grep -E '^(State|SigQ|SigPnd|ShdPnd|SigBlk)' /proc/$p/status; date +%s.%N`)
			t.Fatalf("%s: the impostor did not run after the restore within 30s (host time %.3f, wake done at %.3f):\n%s",
				id, float64(time.Now().UnixNano())/1e9, float64(to.UnixNano())/1e9, diag)
		}
	}
}

// lastTry is the time of the impostor's last logged attempt.
func lastTry(log string) float64 {
	var last float64
	for _, l := range strings.Split(log, "\n") {
		var ts float64
		var n int
		var what string
		if c, _ := fmt.Sscanf(l, "%f try %d %s", &ts, &n, &what); c == 3 {
			last = ts
		}
	}
	return last
}

// attackImpersonation: a setsid, double-forked process loops trying to take the agent's
// place on the node's socket across suspend + wake and across a clone. The agent
// freezes every process of the sandbox before the checkpoint and thaws them only after
// the restored copy has its new identity and has connected, so the impostor never runs
// while the agent is not connected: the host keeps talking to the real agent (the
// identity generation is the node's, the files API returns real content), and the
// impostor's own log shows the node never accepted it.
func attackImpersonation(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{})
	marker := fmt.Sprintf("real-%d", time.Now().UnixNano())
	su.put(t, sb.ID, "/root/marker", marker, 0o644)
	su.put(t, sb.ID, "/tmp/impostor.py", impostorScript, 0o644)
	su.mustSh(t, sb.ID, "python3 /tmp/impostor.py /tmp/impostor.log 120")
	e2etest.WaitFor(t, 30*time.Second, "the impostor to try", func() bool {
		return strings.Contains(su.mustSh(t, sb.ID, "cat /tmp/impostor.log 2>/dev/null; true"), "REFUSED")
	})
	defer su.sh(t, sb.ID, "kill -9 $(cat /tmp/impostor.log.pid) 2>/dev/null; true")

	c := e2etest.Ctx(t, 3*time.Minute)
	if _, err := su.s.C.LifecycleAndWait(c, sb.ID, "suspend"); err != nil {
		t.Fatalf("suspend: %v", err)
	}
	from := time.Now()
	if op, err := su.s.C.LifecycleAndWait(c, sb.ID, "wake"); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("wake: %+v %v", op, err)
	}
	su.checkAgentIsReal(t, sb.ID, marker, from, time.Now())

	from = time.Now()
	clones, err := su.s.C.Clone(c, sb.ID, api.CloneRequest{Count: 1})
	if err != nil || len(clones) != 1 {
		t.Fatalf("clone: %v %v", clones, err)
	}
	clone := clones[0]
	t.Cleanup(func() { _, _ = su.s.C.DeleteSandbox(context.Background(), clone.ID) })
	e2etest.WaitFor(t, 2*time.Minute, "the clone and its source to run", func() bool {
		a, err1 := su.s.C.GetSandbox(c, clone.ID)
		b, err2 := su.s.C.GetSandbox(c, sb.ID)
		if err1 != nil || err2 != nil || a.State == api.StateFailed || b.State == api.StateFailed {
			t.Fatalf("clone %+v %v, source %+v %v", a, err1, b, err2)
		}
		return a.State == api.StateRunning && b.State == api.StateRunning && b.DesiredState == api.StateRunning
	})
	to := time.Now()
	for _, id := range []string{sb.ID, clone.ID} {
		su.checkAgentIsReal(t, id, marker, from, to)
	}
	su.sh(t, clone.ID, "kill -9 $(cat /tmp/impostor.log.pid) 2>/dev/null; true")
}

// fakeAgentScript stands in for the agent, as sandbox root may try to: it connects to
// the node's socket in a loop (every millisecond), asks for the control connection as
// the agent does (presenting the key in /tmp/fake.key if there is one, else none) and,
// once the node takes it (sends it the key), makes a data connection whenever the node
// asks for one and serves its own HTTP on it. While the agent's own connection answers
// the node refuses it; after a restart of the node it is refused unless it presents
// the agent's key, which sandbox root cannot learn (the test hands it over).
// /v1/health and every path it does not name answer with a 1 GiB body; GET
// /v1/processes never ends (a byte every 200 ms); it accepts a process (pid 4242) whose
// output stream is garbage frames. It signals that the node took it with a file in the
// run directory, which the host sees.
const fakeAgentScript = `
import http.server, json, os, socket, struct, sys, threading, time
path = '/run/space/node.sock'
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def log_message(self, *a): pass
    def head(self, status, ctype, length=None):
        self.send_response(status)
        self.send_header('Content-Type', ctype)
        if length is not None: self.send_header('Content-Length', str(length))
        else: self.send_header('Connection', 'close')
        self.end_headers()
    def huge(self):
        self.head(200, 'application/json', 1 << 30)
        chunk = b'{"version":"' + b'x' * ((1 << 20) - 12)
        try:
            for _ in range(1024): self.wfile.write(chunk)
        except OSError: pass
    def endless(self):
        self.head(200, 'application/json')
        try:
            self.wfile.write(b'[')
            self.wfile.flush()
            end = time.time() + 120
            while time.time() < end:
                time.sleep(0.2); self.wfile.write(b' '); self.wfile.flush()
        except OSError: pass
    def info(self, status=200):
        b = json.dumps({'pid': 4242, 'uid': 'fake-4242', 'argv': ['fake'], 'state': 'running', 'written': 0, 'retained': 0}).encode()
        self.head(status, 'application/json', len(b)); self.wfile.write(b)
    def garbage(self):
        self.head(200, 'application/octet-stream')
        try:
            for i in range(64): self.wfile.write(struct.pack('>BQI', 0x7f, i, 16) + os.urandom(16))
            self.wfile.write(struct.pack('>BQI', 1, 0, 0xfffffff0) + os.urandom(1 << 16))
            end = time.time() + 30
            while time.time() < end: self.wfile.write(os.urandom(1 << 16)); time.sleep(0.01)
        except OSError: pass
    def do_GET(self):
        p = self.path.split('?')[0]
        if p == '/v1/processes': return self.endless()
        if p == '/v1/processes/4242': return self.info()
        if p == '/v1/processes/4242/output': return self.garbage()
        return self.huge()
    def do_POST(self):
        n = int(self.headers.get('Content-Length') or 0)
        if n: self.rfile.read(n)
        p = self.path.split('?')[0]
        if p == '/v1/processes': return self.info(201)
        if p == '/v1/processes/4242/start':
            self.head(204, 'application/json', 0); return
        return self.huge()
def serve(key):
    d = socket.socket(socket.AF_UNIX)
    try:
        d.connect(path); d.sendall(('space-agent data %s\n' % key).encode())
        H(d, ('fake', 0), None)
    except Exception: pass
    try: d.shutdown(socket.SHUT_RDWR)
    except OSError: pass
    d.close()
def control():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    k = open('/tmp/fake.key').read().strip() if os.path.exists('/tmp/fake.key') else '-'
    s.sendall(('space-agent control %s\n' % k).encode())
    f = s.makefile('rb')
    line = f.readline().decode(errors='replace').split()
    if len(line) != 2 or line[0] != 'key':
        f.close(); s.close(); return None, None
    return s, (f, line[1])
if os.fork(): sys.exit(0)
os.setsid()
refused = 0
while True:
    try: s, rest = control()
    except OSError: s = None
    if s is not None: break
    refused += 1
    time.sleep(0.001)
print('taken after %d refusals or failed connects' % refused, flush=True)
open('/run/space/fake.ready', 'w').close()
f, key = rest
for line in f:
    line = line.strip()
    if line == b'dial': threading.Thread(target=serve, args=(key,), daemon=True).start()
    elif line == b'ping': s.sendall(b'pong\n')
`

// TestHostileAgentAfterRestart: sandbox root cannot replace its agent while the agent
// is connected (the node refuses other connections while the agent's answers:
// TestAdversarial/AgentImpersonationAfterRestore; it cannot stop the agent either, which
// gVisor's ptrace refuses), nor when the node restarts: a process that connects first
// is refused without the agent's key (until 2026-12-07 it took the agent's place).
// Given the key (as a compromised agent, or a VM's root, would have it), a process that
// connects first takes the agent's place, as the threat model allows. Such a hostile HTTP server then
// fails only its own sandbox's requests: the API answers them with a clear 502 within
// the agent client's bounds (size and time), the server's memory does not grow by more
// than a few MiB while the node's own health polls meet 1 GiB bodies, and the sandbox
// can still be deleted. (Until 2026-12-06 this was TestAdversarial/AgentReplacedAtRuntime:
// the agent listened on a socket root could unlink and bind itself.)
func TestHostileAgentAfterRestart(t *testing.T) {
	su := &suite{s: e2etest.Start(t, e2etest.Options{})}
	sb := su.s.Create(t, api.CreateSandboxRequest{})
	su.put(t, sb.ID, "/tmp/fake.py", fakeAgentScript, 0o644)
	su.mustSh(t, sb.ID, "python3 /tmp/fake.py </dev/null >/tmp/fake.log 2>&1")
	ready := filepath.Join(su.s.DataDir, "runtime", sb.ID, "run", "fake.ready")
	// The agent answers: the fake is refused.
	time.Sleep(2 * time.Second)
	if _, err := os.Stat(ready); err == nil {
		t.Fatal("the node took the fake in the place of a connected agent")
	}
	if out := su.mustSh(t, sb.ID, "echo real"); out != "real\n" {
		t.Fatalf("the real agent: %q", out)
	}
	// Restarts: the agent connects again within a second; the fake, trying every
	// millisecond, is most often first, and is refused: the agent's command answers.
	// (Were the fake taken, the command would meet its HTTP and fail.)
	for round := 1; round <= 2; round++ {
		su.s.Kill()
		su.s.Restart()
		out := su.mustSh(t, sb.ID, "echo real")
		if _, err := os.Stat(ready); err == nil || out != "real\n" {
			t.Fatalf("restart %d: the fake without the key took the agent's place (echo: %q)", round, out)
		}
	}
	// The fake gets the agent's key, which the node keeps in the instance's state
	// directory out of the sandbox's sight.
	key, err := os.ReadFile(filepath.Join(su.s.DataDir, "runtime", sb.ID, "agent-link.key"))
	if err != nil {
		t.Fatal(err)
	}
	su.put(t, sb.ID, "/tmp/fake.key", string(key), 0o600)
	// A restart: the fake, with the key, is most often first. The real agent may win a
	// round: restart again.
	taken := false
	for round := 0; round < 4 && !taken; round++ {
		su.s.Kill()
		su.s.Restart()
		deadline := time.Now().Add(15 * time.Second)
		for !taken && time.Now().Before(deadline) {
			_, err := os.Stat(ready)
			taken = err == nil
			time.Sleep(50 * time.Millisecond)
		}
		t.Logf("restart %d: the fake took the agent's place: %v", round+1, taken)
	}
	if !taken {
		t.Fatal("the fake never took the agent's place in 4 restarts")
	}
	rssBefore := rssKB(su.s.Pid())
	stopRSS := su.rssWatch()

	// Requests for the hostile sandbox, straight over HTTP (the Go client retries a GET
	// that failed with 502, which would hide how long one took).
	type result struct {
		what   string
		status int
		took   time.Duration
		body   string
	}
	var wg sync.WaitGroup
	results := make(chan result, 8)
	call := func(what, method, path, body string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := result{what: what}
			r.status, r.body, r.took = su.raw(method, path, body)
			results <- r
		}()
	}
	call("GET processes (never-ending answer)", "GET", "/v1/sandboxes/"+sb.ID+"/processes", "")
	call("GET processes/7 (1 GiB answer)", "GET", "/v1/sandboxes/"+sb.ID+"/processes/7", "")
	var attach result
	wg.Add(1)
	go func() {
		defer wg.Done()
		attach = su.attachGarbage(sb.ID)
	}()
	// Meanwhile the node polls the fake's /v1/health (1 GiB) every 2 s in the background.
	wg.Wait()
	close(results)
	for _, r := range append(collect(results), attach) {
		t.Logf("%s: %d after %v: %s", r.what, r.status, r.took.Round(time.Millisecond), r.body)
		if r.status != http.StatusBadGateway {
			t.Errorf("%s: status %d (%s), want 502", r.what, r.status, r.body)
		}
		if r.took > 45*time.Second {
			t.Errorf("%s took %v: beyond the agent client's 30 s bound", r.what, r.took)
		}
	}
	t.Run("FileRepliesBounded", func(t *testing.T) {
		for _, c := range [][3]string{{"GET", "/v1/sandboxes/" + sb.ID + "/files/stat?path=/etc/hostname", ""},
			{"POST", "/v1/sandboxes/" + sb.ID + "/files/mkdir", `{"path":"/tmp/x"}`}} {
			if status, body, took := su.raw(c[0], c[1], c[2]); status != http.StatusBadGateway {
				t.Errorf("%s %s: %d after %v (%.80s), want 502", c[0], c[1], status, took, body)
			}
		}
	})
	// The sandbox's own record is served as usual.
	if got, err := su.s.C.GetSandbox(e2etest.Ctx(t, time.Minute), sb.ID); err != nil || got.State != api.StateRunning {
		t.Errorf("GET the hostile sandbox: %+v %v", got, err)
	}
	peak := stopRSS()
	t.Logf("space serve RSS: %d KiB before, peak %d KiB while answering the fake agent", rssBefore, peak)
	if peak-rssBefore > 16<<10 {
		t.Errorf("space serve RSS grew by %d KiB talking to a hostile agent", peak-rssBefore)
	}
	// Deleting the sandbox needs nothing from its agent.
	op, err := su.s.C.DeleteSandbox(e2etest.Ctx(t, time.Minute), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := su.s.C.WaitOperation(e2etest.Ctx(t, 2*time.Minute), op.ID); err != nil || got.State != api.OpSucceeded {
		t.Errorf("delete the hostile sandbox: %+v %v", got, err)
	}
}

func collect[T any](c <-chan T) []T {
	var out []T
	for v := range c {
		out = append(out, v)
	}
	return out
}
