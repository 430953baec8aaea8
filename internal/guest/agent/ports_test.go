package agent_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/guest/wire"
)

// bufConn is a connection whose first bytes were read into a bufio.Reader.
type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (c bufConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// openTunnel asks the agent for a tunnel to port. It returns the tunnel when the agent
// switched protocols, else the agent's answer.
func openTunnel(t *testing.T, sock string, port int, upgrade bool) (net.Conn, *http.Response) {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	req := fmt.Sprintf("GET /v1/ports/%d/connect HTTP/1.1\r\nHost: agent\r\n", port)
	if upgrade {
		req += "Connection: Upgrade\r\nUpgrade: " + wire.PortUpgrade + "\r\n"
	}
	if _, err := io.WriteString(c, req+"\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Time{})
	if resp.StatusCode != http.StatusSwitchingProtocols {
		c.Close()
		return nil, resp
	}
	return bufConn{Conn: c, r: br}, resp
}

func TestPortTunnel(t *testing.T) {
	e := startAgent(t, nil)

	// HTTP through a tunnel, on a keep-alive connection (two requests).
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s %s host=%s", r.Method, r.URL.Path, r.Host)
	}))
	defer srv.Close()
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	tunnelsOpened := 0
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		c, resp := openTunnel(t, e.sock, port, true)
		if c == nil {
			return nil, fmt.Errorf("tunnel: %s", resp.Status)
		}
		tunnelsOpened++
		return c, nil
	}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	for _, p := range []string{"/one", "/two"} {
		resp, err := hc.Get("http://8000-sandbox.example" + p)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := "GET " + p + " host=8000-sandbox.example"; string(b) != want {
			t.Errorf("through the tunnel: %q, want %q", b, want)
		}
	}
	if tunnelsOpened != 1 {
		t.Errorf("%d tunnels for two requests on one keep-alive connection", tunnelsOpened)
	}

	// Raw bytes both ways, including bytes sent right behind the request.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					fmt.Fprintf(c, "echo %s\n", strings.ToUpper(sc.Text()))
				}
			}()
		}
	}()
	echoPort := ln.Addr().(*net.TCPAddr).Port
	c, err := net.Dial("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /v1/ports/%d/connect HTTP/1.1\r\nHost: agent\r\nConnection: keep-alive, Upgrade\r\nUpgrade: %s\r\n\r\nearly\n", echoPort, wire.PortUpgrade)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 101 || resp.Header.Get("Upgrade") != wire.PortUpgrade {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	fmt.Fprintf(c, "late\n")
	for _, want := range []string{"echo EARLY\n", "echo LATE\n"} {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		line, err := br.ReadString('\n')
		if err != nil || line != want {
			t.Fatalf("raw relay: %q %v, want %q", line, err, want)
		}
	}

	// Nothing listening: 502 naming the port; no upgrade asked: 426.
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()
	_, resp = openTunnel(t, e.sock, closedPort, true)
	var werr wire.Error
	_ = json.NewDecoder(resp.Body).Decode(&werr)
	if resp.StatusCode != 502 || werr.Code != wire.ErrCodePortClosed || !strings.Contains(werr.Message, fmt.Sprint(closedPort)) {
		t.Errorf("closed port: %d %+v", resp.StatusCode, werr)
	}
	// Through the status tunnel the refusal comes as 200 with the status in a header.
	tc, err := net.Dial("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(tc, "GET /v1/ports/%d/connect HTTP/1.1\r\nHost: agent\r\nConnection: Upgrade\r\nUpgrade: %s\r\n%s: 1\r\n\r\n", closedPort, wire.PortUpgrade, envdpb.TunnelHeader)
	resp, err = http.ReadResponse(bufio.NewReader(tc), nil)
	tc.Close()
	if err != nil || resp.StatusCode != 200 || resp.Header.Get(envdpb.StatusHeader) != "502" {
		t.Errorf("tunneled refusal: %v %v", resp, err)
	}
	if _, resp = openTunnel(t, e.sock, echoPort, false); resp.StatusCode != http.StatusUpgradeRequired {
		t.Errorf("without upgrade: %d", resp.StatusCode)
	}
	if _, resp = openTunnel(t, e.sock, 70000, true); resp.StatusCode != 400 {
		t.Errorf("bad port: %d", resp.StatusCode)
	}

	// A quiesce closes open tunnels (a checkpoint cannot keep them).
	ctx := testCtx(t, 30*time.Second)
	if err := e.c.Quiesce(ctx, false); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := br.Read(make([]byte, 16)); err == nil || isTimeout(err) {
		t.Errorf("tunnel still open after a quiesce: %d %v", n, err)
	}
	if err := agentclient.WaitQuiesced(ctx, e.runDir); err != nil {
		t.Fatal(err)
	}
	if err := agentclient.WriteResume(e.runDir, wire.Identity{Generation: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if c, resp := openTunnel(t, e.sock, echoPort, true); c == nil {
		t.Errorf("tunnel after resume: %s", resp.Status)
	} else {
		c.Close()
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
