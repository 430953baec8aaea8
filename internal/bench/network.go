package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/network"
)

// The network scenario: egress throughput from a sandbox vs the same download made
// from the host; port-forward request latency and throughput vs the same requests
// made inside the sandbox; and the time a policy change takes to be in force.
//
// Egress needs a server sandboxes may reach: Config.EgressURL (one that serves
// /bytes/{n}, like internal/network/fakenet's web servers). Without it the egress rows
// are skipped: the bench never reaches a host it was not told to.

// netBlobMiB is the size of the downloads.
const netBlobMiB = 128

// curlArgs is curl printing its transfer time and size (the same reader on both sides).
func curlArgs(u string) []string {
	return []string{"curl", "-fsS", "--max-time", "120", "-o", "/dev/null", "-w", "%{time_total} %{size_download}\n", u}
}

// parseCurl reads curl's "seconds bytes" line.
func parseCurl(out string) (secs float64, bytes int64, err error) {
	f := strings.Fields(strings.TrimSpace(out))
	if len(f) < 2 {
		return 0, 0, fmt.Errorf("curl printed %q", out)
	}
	if secs, err = strconv.ParseFloat(f[0], 64); err != nil {
		return 0, 0, fmt.Errorf("curl printed %q", out)
	}
	if bytes, err = strconv.ParseInt(f[1], 10, 64); err != nil {
		return 0, 0, fmt.Errorf("curl printed %q", out)
	}
	return secs, bytes, nil
}

// execOut runs argv in a sandbox and returns its stdout.
func execOut(ctx context.Context, c *client.Client, id string, argv ...string) (string, error) {
	var out, errb bytes.Buffer
	code, err := c.Exec(ctx, id, api.CreateSessionRequest{Argv: argv}, client.Output{Stdout: &out, Stderr: &errb})
	if err != nil {
		return "", err
	}
	if code != 0 {
		return "", fmt.Errorf("%v: exit %d: %s", argv, code, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

func networkBench(ctx context.Context, cfg *Config) ([]Result, error) {
	var out []Result
	if cfg.EgressURL != "" {
		rs, err := egressBench(ctx, cfg)
		if err != nil {
			return out, err
		}
		out = append(out, rs...)
	}
	rs, err := portBench(ctx, cfg)
	if err != nil {
		return out, err
	}
	out = append(out, rs...)
	if cfg.EgressURL == "" && len(out) > 0 {
		out[0].Note = "egress rows skipped: no --egress-url (a server sandboxes may reach that serves /bytes/{n})"
	}
	return out, nil
}

// egressBench downloads netBlobMiB from EgressURL inside a sandbox whose policy allows
// only that host, and from the host (in EgressNetns when set), with curl both times.
func egressBench(ctx context.Context, cfg *Config) ([]Result, error) {
	u, err := url.Parse(cfg.EgressURL)
	if err != nil || u.Hostname() == "" {
		return nil, fmt.Errorf("egress URL %q: want http://HOST[:PORT]", cfg.EgressURL)
	}
	blob := strings.TrimRight(cfg.EgressURL, "/") + "/bytes/" + strconv.Itoa(netBlobMiB<<20)
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{Network: &api.Network{
		Egress: true, AllowOut: []string{u.Hostname()}, DenyOut: []string{"0.0.0.0/0"},
	}})
	if err != nil {
		return nil, err
	}
	defer done()
	var host *network.NS
	if cfg.EgressNetns != "" {
		if host, err = network.OpenNS(cfg.EgressNetns); err != nil {
			return nil, err
		}
		defer host.Close()
	}
	runs := min(cfg.Runs, 5)
	var xs, bs []float64
	for range runs {
		o, err := execOut(ctx, cfg.Client, sb.ID, curlArgs(blob)...)
		if err != nil {
			return nil, fmt.Errorf("download in the sandbox: %w", err)
		}
		secs, n, err := parseCurl(o)
		if err != nil || n != netBlobMiB<<20 {
			return nil, fmt.Errorf("download in the sandbox: %d bytes, %v", n, err)
		}
		xs = append(xs, float64(n)/(1<<20)/secs)
		var hostOut []byte
		run := func() error {
			var err error
			hostOut, err = exec.CommandContext(ctx, curlArgs(blob)[0], curlArgs(blob)[1:]...).Output()
			return err
		}
		if host != nil {
			err = host.Do(run) // the child starts on a thread in the namespace
		} else {
			err = run()
		}
		if err != nil {
			return nil, fmt.Errorf("download from the host: %w", err)
		}
		secs, n, err = parseCurl(string(hostOut))
		if err != nil {
			return nil, err
		}
		bs = append(bs, float64(n)/(1<<20)/secs)
	}
	r := result("network", fmt.Sprintf("egress: %d MiB download (curl)", netBlobMiB), "MiB/s", xs, "the same from the host", bs)
	r.Note = "ratio = sandbox / host, higher is better; the sandbox's egress crosses its veth, the node's rules and NAT"
	return []Result{r}, nil
}

// policyChange measures PATCH /v1/sandboxes/{id}/network round trips, alternating two
// policies; each answer comes once the node has the new rules in force.
func policyChange(ctx context.Context, cfg *Config, id string) (Result, error) {
	var xs []float64
	for i := range max(cfg.Runs, 5) {
		allow := []string{"198.51.100.0/24"}
		if i%2 == 1 {
			allow = []string{"203.0.113.0/24", "pypi.org"}
		}
		start := time.Now()
		st, err := cfg.Client.PatchNetwork(ctx, id, map[string]any{"egress": true, "allow_out": allow, "deny_out": []string{"0.0.0.0/0"}})
		if err != nil {
			return Result{}, err
		}
		if !st.Applied {
			return Result{}, fmt.Errorf("policy change not applied: %+v", st)
		}
		xs = append(xs, ms(time.Since(start)))
	}
	r := result("network", "policy change (PATCH → in force)", "ms", xs, "", nil)
	r.Note = "API round trip; the node replaces the sandbox's nftables tables in one transaction and cuts connections the new policy denies"
	return r, nil
}

// sandboxHTTP is a small HTTP server for inside the sandbox (Python's standard library):
// /small answers 2 bytes, /blob netBlobMiB of zeros; HTTP/1.1 keep-alive, threaded.
const sandboxHTTP = `import http.server, socketserver, sys
BLOB = bytes(%d)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        b = BLOB if self.path == "/blob" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("127.0.0.1", 8000), H).serve_forever()
`

// inSandboxLatency times n GETs of /small inside the sandbox (a new connection each,
// as port-forward makes one per request here): milliseconds each.
const inSandboxLatency = `import http.client, time, sys
for i in range(int(sys.argv[1])):
    t = time.time()
    c = http.client.HTTPConnection("127.0.0.1", 8000)
    c.request("GET", "/small"); c.getresponse().read(); c.close()
    print((time.time() - t) * 1000, flush=True)
`

// portBench starts a server inside a sandbox without network and measures requests to
// it through space (the API's port proxy and port-forward tunnels) against the same
// requests made inside the sandbox.
func portBench(ctx context.Context, cfg *Config) ([]Result, error) {
	sb, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{Network: &api.Network{}})
	if err != nil {
		// A server without networking: the port rows still run, without a policy row.
		if sb, done, err = sandbox(ctx, cfg, api.CreateSandboxRequest{}); err != nil {
			return nil, err
		}
	}
	defer done()
	c := cfg.Client
	if _, err := c.WriteFile(ctx, sb.ID, "/tmp/bench-http.py", strings.NewReader(fmt.Sprintf(sandboxHTTP, netBlobMiB<<20)), client.FileOptions{}); err != nil {
		return nil, err
	}
	if _, err := c.WriteFile(ctx, sb.ID, "/tmp/bench-lat.py", strings.NewReader(inSandboxLatency), client.FileOptions{}); err != nil {
		return nil, err
	}
	sess, err := c.CreateSession(ctx, sb.ID, api.CreateSessionRequest{Argv: []string{"python3", "/tmp/bench-http.py"}})
	if err != nil {
		return nil, err
	}
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _, _ = c.Follow(sctx, sess, client.Output{Stdout: io.Discard, Stderr: io.Discard}) }()
	defer func() { _ = c.SignalSession(context.WithoutCancel(ctx), sess, "KILL") }()

	proxyURL := c.BaseURL + "/v1/sandboxes/" + sb.ID + "/ports/8000"
	hc := &http.Client{Timeout: 2 * time.Minute}
	get := func(path string) (int64, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, proxyURL+path, nil)
		if err != nil {
			return 0, err
		}
		req.Header.Set("Authorization", "Bearer "+c.APIKey)
		resp, err := hc.Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		n, err := io.Copy(io.Discard, resp.Body)
		if err == nil && resp.StatusCode != 200 {
			err = fmt.Errorf("GET %s: %s", path, resp.Status)
		}
		return n, err
	}
	deadline := time.Now().Add(time.Minute)
	for {
		if _, err := get("/small"); err == nil {
			break
		} else if time.Now().After(deadline) {
			return nil, fmt.Errorf("the server in the sandbox did not answer: %w", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	runs := max(cfg.Runs, 10)
	// Latency: through the API proxy (kept-alive connections), through a port-forward
	// tunnel (a new tunnel per request), and inside the sandbox.
	var proxyLat, tunnelLat, inLat []float64
	for range runs {
		start := time.Now()
		if _, err := get("/small"); err != nil {
			return nil, err
		}
		proxyLat = append(proxyLat, ms(time.Since(start)))
		start = time.Now()
		if err := tunnelGet(ctx, c, sb.ID, "/small"); err != nil {
			return nil, err
		}
		tunnelLat = append(tunnelLat, ms(time.Since(start)))
	}
	o, err := execOut(ctx, c, sb.ID, "python3", "/tmp/bench-lat.py", strconv.Itoa(runs))
	if err != nil {
		return nil, err
	}
	for _, l := range strings.Fields(o) {
		v, err := strconv.ParseFloat(l, 64)
		if err != nil {
			return nil, fmt.Errorf("in-sandbox latency: %q", l)
		}
		inLat = append(inLat, v)
	}
	out := []Result{
		result("network", "port proxy: GET of 2 bytes (API, kept alive)", "ms", proxyLat, "the same GET inside the sandbox", inLat),
		result("network", "port-forward: GET of 2 bytes (new tunnel each)", "ms", tunnelLat, "the same GET inside the sandbox", inLat),
	}
	// Throughput: netBlobMiB through the proxy, vs curl inside the sandbox.
	var proxyTP, inTP []float64
	for range min(cfg.Runs, 5) {
		start := time.Now()
		n, err := get("/blob")
		if err != nil {
			return nil, err
		}
		proxyTP = append(proxyTP, float64(n)/(1<<20)/time.Since(start).Seconds())
		o, err := execOut(ctx, c, sb.ID, curlArgs("http://127.0.0.1:8000/blob")...)
		if err != nil {
			return nil, err
		}
		secs, n, err := parseCurl(o)
		if err != nil {
			return nil, err
		}
		inTP = append(inTP, float64(n)/(1<<20)/secs)
	}
	r := result("network", fmt.Sprintf("port proxy: %d MiB download", netBlobMiB), "MiB/s", proxyTP, "curl inside the sandbox", inTP)
	r.Note = "ratio = through space / inside, higher is better; bytes cross API → node → agent → the port"
	out = append(out, r)
	if sb.Network != nil {
		pr, err := policyChange(ctx, cfg, sb.ID)
		if err != nil {
			return out, err
		}
		out = append(out, pr)
	}
	return out, nil
}

// tunnelGet makes one HTTP/1.0 GET through a new port-forward tunnel.
func tunnelGet(ctx context.Context, c *client.Client, id, path string) error {
	conn, err := c.DialPort(ctx, id, 8000)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n", path); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	if err == nil && resp.StatusCode != 200 {
		err = fmt.Errorf("tunnel GET %s: %s", path, resp.Status)
	}
	return err
}
