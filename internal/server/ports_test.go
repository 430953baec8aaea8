package server_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/websocket"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
)

// sandboxServer starts an HTTP server where the fake runtime's sandboxes see it (their
// loopback is the host's: its agents are host processes) and returns its port.
func sandboxServer(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/hello/{rest...}", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "hi %s %s q=%s host=%s auth=%q body=%s", r.Method, r.URL.Path, r.URL.Query().Get("q"), r.Host, r.Header.Get("Authorization")+r.Header.Get("X-Api-Key"), b)
	})
	mux.Handle("/ws", websocket.Handler(func(c *websocket.Conn) { _, _ = io.Copy(c, c) }))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return l.Addr().(*net.TCPAddr).Port
}

// freePort returns a port nothing listens on.
func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
}

// TestSandboxPorts: a port inside a sandbox without any network is reached through the
// API's HTTP proxy (paths, queries, bodies, WebSocket upgrades; space's credentials
// are not passed on) and as a raw TCP tunnel (port-forward); a port nobody listens on
// is a 502 that names it; another tenant's sandbox is 404; bad ports are 400.
func TestSandboxPorts(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	if sb.Network != nil {
		t.Fatalf("sandbox has a network: %+v", sb.Network)
	}
	port := sandboxServer(t)
	base := "/v1/sandboxes/" + sb.ID + "/ports/" + strconv.Itoa(port)

	code, body := do(t, s, "GET", base+"/hello/a/b?q=1", "")
	want := fmt.Sprintf(`hi GET /hello/a/b q=1 host=localhost:%d auth="" body=`, port)
	if code != 200 || body != want {
		t.Fatalf("GET through the proxy: %d %q, want %q", code, body, want)
	}
	code, body = do(t, s, "POST", base+"/hello/x", `{"n":1}`, "X-API-Key", s.AdminKey)
	if code != 200 || !strings.HasSuffix(body, `auth="" body={"n":1}`) {
		t.Fatalf("POST through the proxy: %d %q", code, body)
	}

	// WebSocket through the proxy.
	wsURL := "ws" + strings.TrimPrefix(s.URL, "http") + base + "/ws"
	cfg, err := websocket.NewConfig(wsURL, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Header.Set("Authorization", "Bearer "+s.AdminKey)
	ws, err := websocket.DialConfig(cfg)
	if err != nil {
		t.Fatalf("websocket through the proxy: %v", err)
	}
	if _, err := ws.Write([]byte("ping over ws")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_ = ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := ws.Read(buf)
	ws.Close()
	if err != nil || string(buf[:n]) != "ping over ws" {
		t.Fatalf("websocket echo: %q %v", buf[:n], err)
	}

	// A raw TCP tunnel: what space port-forward does per connection.
	conn, err := s.C.DialPort(ctx(t), sb.ID, port)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "GET /hello/raw HTTP/1.0\r\nHost: x\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	conn.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(string(b), "hi GET /hello/raw") {
		t.Fatalf("through the tunnel: %d %q", resp.StatusCode, b)
	}

	// Nobody listens: 502 naming the port, for the proxy and the tunnel.
	closed := freePort(t)
	code, body = do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/ports/"+strconv.Itoa(closed)+"/", "")
	if code != http.StatusBadGateway || !strings.Contains(body, fmt.Sprintf("nothing listens on port %d", closed)) {
		t.Fatalf("proxy to a closed port: %d %s", code, body)
	}
	_, err = s.C.DialPort(ctx(t), sb.ID, closed)
	var ce *client.Error
	if !asClientError(err, &ce) || ce.Status != http.StatusBadGateway || !strings.Contains(ce.Message, strconv.Itoa(closed)) {
		t.Fatalf("tunnel to a closed port: %v", err)
	}

	// Bad ports, plain GETs of the tunnel, other tenants.
	for _, p := range []string{"0", "65536", "http"} {
		if code, body := do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/ports/"+p+"/", ""); code != 400 || !strings.Contains(body, "port") {
			t.Errorf("port %s: %d %s", p, code, body)
		}
	}
	if code, body := do(t, s, "GET", base, ""); code != 400 || !strings.Contains(body, "Upgrade: space-tcp") {
		t.Errorf("tunnel without upgrade: %d %s", code, body)
	}
	other := client.New(s.URL, s.NewKey("other", false, service.KeySpace))
	if _, err := other.DialPort(ctx(t), sb.ID, port); !client.IsNotFound(err) {
		t.Errorf("another tenant's tunnel: %v", err)
	}
	req, _ := http.NewRequest("GET", s.URL+base+"/hello/x", nil)
	req.Header.Set("Authorization", "Bearer "+other.APIKey)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 404 {
		t.Errorf("another tenant's proxy request: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	req, _ = http.NewRequest("GET", s.URL+base+"/hello/x", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 401 {
		t.Errorf("proxy request without a key: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
}

func asClientError(err error, target **client.Error) bool {
	e, ok := err.(*client.Error)
	if ok {
		*target = e
	}
	return ok
}
