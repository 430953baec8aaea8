package fcfake

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fake is an in-process Server on a unix socket in a temporary directory (the working
// directory of relative paths), with an HTTP client for it.
type fake struct {
	t   *testing.T
	srv *Server
	dir string
	hc  *http.Client
}

func newFake(t *testing.T, opts Options) *fake {
	t.Helper()
	dir := t.TempDir()
	opts.Dir = dir
	srv, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := srv.Listen("api.sock")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv.Serve(ln)
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		srv.Close()
	})
	sock := filepath.Join(dir, "api.sock")
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	return &fake{t: t, srv: srv, dir: dir, hc: hc}
}

// do sends a request and returns the status and fault message.
func (f *fake) do(method, path, body string) (int, string) {
	f.t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://localhost"+path, r)
	if err != nil {
		f.t.Fatal(err)
	}
	resp, err := f.hc.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	var fm struct {
		FaultMessage string `json:"fault_message"`
	}
	if resp.StatusCode == http.StatusBadRequest {
		if err := json.Unmarshal(data, &fm); err != nil || fm.FaultMessage == "" {
			f.t.Fatalf("%s %s: 400 without a fault_message body: %q", method, path, data)
		}
	}
	return resp.StatusCode, fm.FaultMessage
}

// must sends a request that must succeed.
func (f *fake) must(method, path, body string) {
	f.t.Helper()
	if st, msg := f.do(method, path, body); st != http.StatusNoContent {
		f.t.Fatalf("%s %s %s: %d %s", method, path, body, st, msg)
	}
}

// refused sends a request that must be refused with a fault message containing want.
func (f *fake) refused(method, path, body, want string) {
	f.t.Helper()
	st, msg := f.do(method, path, body)
	if st != http.StatusBadRequest || !strings.Contains(msg, want) {
		f.t.Errorf("%s %s %s: %d %q, want 400 with %q", method, path, body, st, msg, want)
	}
}

// file creates a file in the fake's directory.
func (f *fake) file(name, content string) {
	f.t.Helper()
	if err := os.WriteFile(filepath.Join(f.dir, name), []byte(content), 0o644); err != nil {
		f.t.Fatal(err)
	}
}

// bootArgs is a kernel command line naming the agent's vsock port as space does.
func bootArgs(port int) string {
	env, _ := json.Marshal(map[string]string{"SPACE_AGENT_LISTEN": fmt.Sprintf("vsock:%d", port)})
	return "console=ttyS0 space.vm=1 space.env=" + base64.RawURLEncoding.EncodeToString(env)
}

// configure sends a complete pre-boot configuration.
func (f *fake) configure() {
	f.t.Helper()
	f.file("vmlinux", "\x7fELF kernel")
	f.file("initrd", "cpio")
	f.file("disk.ext4", "ext4")
	f.must("PUT", "/boot-source", fmt.Sprintf(`{"kernel_image_path":"vmlinux","initrd_path":"initrd","boot_args":%q}`, bootArgs(1024)))
	f.must("PUT", "/drives/rootfs", `{"drive_id":"rootfs","path_on_host":"disk.ext4","is_root_device":true,"is_read_only":false}`)
	f.must("PUT", "/machine-config", `{"vcpu_count":1,"mem_size_mib":16,"smt":false}`)
	f.must("PUT", "/vsock", `{"guest_cid":3,"uds_path":"v.sock"}`)
}

func TestStrictBodies(t *testing.T) {
	f := newFake(t, Options{})
	f.file("vmlinux", "\x7fELF")
	for _, c := range []struct{ path, body, want string }{
		{"/machine-config", `{"vcpu_count":1,"mem_size_mib":128,"foo":1}`, "unknown field `foo`, expected one of `vcpu_count`, `mem_size_mib`"},
		{"/machine-config", `{"Vcpu_count":1,"mem_size_mib":128}`, "unknown field `Vcpu_count`"},
		{"/machine-config", `{"vcpu_count":1,"vcpu_count":2,"mem_size_mib":128}`, "duplicate field `vcpu_count`"},
		{"/machine-config", `{"mem_size_mib":128}`, "missing field `vcpu_count`"},
		{"/machine-config", `{"vcpu_count":"1","mem_size_mib":128}`, "invalid type"},
		{"/machine-config", `{"vcpu_count":33,"mem_size_mib":128}`, "vCPU number is invalid"},
		{"/machine-config", `{"vcpu_count":3,"mem_size_mib":128,"smt":true}`, "vCPU number is invalid"},
		{"/machine-config", `{"vcpu_count":1,"mem_size_mib":128,"huge_pages":"1G"}`, "unknown variant `1G`"},
		{"/machine-config", `{"vcpu_count":1,"mem_size_mib":128} {}`, "trailing characters"},
		{"/machine-config", ``, "EOF while parsing"},
		{"/boot-source", `{"kernel_image_path":"vmlinux","boot_args":"x","initrd":"y"}`, "unknown field `initrd`"},
		{"/boot-source", `{"kernel_image_path":"missing"}`, "The kernel file cannot be opened"},
		{"/drives/rootfs", `{"drive_id":"other","path_on_host":"vmlinux","is_root_device":true}`, "does not match the id from the body"},
		{"/drives/rootfs", `{"drive_id":"rootfs","path_on_host":"vmlinux","is_root_device":true,"rate_limiter":{"bandwidth":{"size":1,"refill_time":1,"extra":0}}}`, "unknown field `extra`"},
		{"/drives/rootfs", `{"drive_id":"rootfs","path_on_host":"nope","is_root_device":true}`, "Unable to create the block device"},
		{"/drives/rootfs", `{"drive_id":"rootfs","path_on_host":"vmlinux"}`, "missing field `is_root_device`"},
		{"/vsock", `{"guest_cid":2,"uds_path":"v.sock"}`, "invalid guest CID"},
		{"/vsock", `{"guest_cid":3}`, "missing field `uds_path`"},
		{"/actions", `{"action_type":"Reboot"}`, "unknown variant `Reboot`"},
		{"/nope", `{}`, "Invalid request method and/or path: PUT /nope"},
	} {
		f.refused("PUT", c.path, c.body, c.want)
	}
	f.refused("DELETE", "/vsock", "", "Invalid request method")
	f.refused("PUT", "/logger", strings.Repeat(" ", maxPayload+1), "larger than the limit")
	// Every call is recorded with its body and answer.
	calls := f.srv.Calls()
	if len(calls) != 22 || calls[0].Status != 400 || !strings.Contains(calls[0].Body, `"foo":1`) || calls[0].Fault == "" {
		t.Errorf("recorded %d calls, first %+v", len(calls), calls[0])
	}
}

func TestCallOrder(t *testing.T) {
	f := newFake(t, Options{})
	f.refused("PATCH", "/vm", `{"state":"Paused"}`, msgBeforeStart)
	f.refused("PUT", "/snapshot/create", `{"snapshot_path":"s","mem_file_path":"m"}`, msgBeforeStart)
	f.refused("PUT", "/actions", `{"action_type":"InstanceStart"}`, "without kernel configuration")
	f.configure()
	f.refused("PUT", "/snapshot/load", `{"snapshot_path":"s","mem_backend":{"backend_type":"File","backend_path":"m"}}`, msgLoadAfter)
	f.must("PUT", "/actions", `{"action_type":"InstanceStart"}`)
	if f.srv.State() != StateRunning {
		t.Fatalf("state %s after InstanceStart", f.srv.State())
	}
	f.refused("PUT", "/machine-config", `{"vcpu_count":2,"mem_size_mib":256}`, msgAfterStart)
	f.refused("PUT", "/boot-source", `{"kernel_image_path":"vmlinux"}`, msgAfterStart)
	f.refused("PUT", "/actions", `{"action_type":"InstanceStart"}`, msgAfterStart)
	f.refused("PUT", "/snapshot/create", `{"snapshot_path":"s","mem_file_path":"m"}`, "not paused")
	f.must("PATCH", "/vm", `{"state":"Paused"}`)
	f.must("PATCH", "/vm", `{"state":"Paused"}`) // idempotent
	f.refused("PUT", "/snapshot/create", `{"snapshot_path":"s","mem_file_path":"m","snapshot_type":"Partial"}`, "unknown variant `Partial`")
	f.must("PUT", "/snapshot/create", `{"snapshot_type":"Full","snapshot_path":"s","mem_file_path":"m"}`)
	if fi, err := os.Stat(filepath.Join(f.dir, "m")); err != nil || fi.Size() != 16<<20 {
		t.Errorf("memory file: %v %v", fi, err)
	}
	f.must("PATCH", "/vm", `{"state":"Resumed"}`)
	f.refused("PUT", "/snapshot/load", `{"snapshot_path":"s","mem_backend":{"backend_type":"File","backend_path":"m"}}`, msgAfterStart)

	// A fresh process loads it; logger and metrics may be configured first.
	g := newFake(t, Options{})
	for _, name := range []string{"vmlinux", "initrd", "disk.ext4"} {
		data, _ := os.ReadFile(filepath.Join(f.dir, name))
		g.file(name, string(data))
	}
	for _, name := range []string{"s", "m"} {
		if err := os.Link(filepath.Join(f.dir, name), filepath.Join(g.dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	g.file("fc.log", "")
	g.must("PUT", "/logger", `{"log_path":"fc.log","level":"debug"}`)
	g.refused("PUT", "/snapshot/load", `{"snapshot_path":"s"}`, "either `mem_backend` or `mem_file_path` is required")
	g.refused("PUT", "/snapshot/load", `{"snapshot_path":"s","mem_file_path":"m","mem_backend":{"backend_type":"File","backend_path":"m"}}`, "exclusively")
	g.must("PUT", "/snapshot/load", `{"snapshot_path":"s","mem_backend":{"backend_type":"File","backend_path":"m"},"resume_vm":true,"vsock_override":{"uds_path":"v2.sock"}}`)
	if g.srv.State() != StateRunning {
		t.Errorf("state %s after a load with resume_vm", g.srv.State())
	}
	if _, err := os.Stat(filepath.Join(g.dir, "v2.sock")); err != nil {
		t.Errorf("vsock override not bound: %v", err)
	}
	g.refused("PUT", "/vsock", `{"guest_cid":3,"uds_path":"v.sock"}`, msgAfterStart)
}

func TestLoadFailureEndsProcess(t *testing.T) {
	failed := make(chan struct{})
	f := newFake(t, Options{OnLoadFailure: func() { close(failed) }})
	f.refused("PUT", "/snapshot/load", `{"snapshot_path":"missing","mem_backend":{"backend_type":"File","backend_path":"m"}}`, "Failed to get snapshot state")
	select {
	case <-failed:
	case <-time.After(5 * time.Second):
		t.Fatal("a failed load did not end the process")
	}
	f.refused("GET", "/", "", "shutting down")
}

func TestVersionGating(t *testing.T) {
	load := `{"snapshot_path":"s","mem_backend":{"backend_type":"File","backend_path":"m"},"vsock_override":{"uds_path":"v.sock"}}`
	old := newFake(t, Options{Version: "1.15.1"})
	old.refused("PUT", "/snapshot/load", load, "unknown field `vsock_override`")
	older := newFake(t, Options{Version: "1.11.0"})
	older.refused("PUT", "/snapshot/load", `{"snapshot_path":"s","mem_file_path":"m","network_overrides":[]}`, "unknown field `network_overrides`")
	st, _ := older.do("GET", "/version", "")
	if st != 200 {
		t.Errorf("GET /version: %d", st)
	}
	resp, err := older.hc.Get("http://localhost/version")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v struct {
		FirecrackerVersion string `json:"firecracker_version"`
	}
	json.NewDecoder(resp.Body).Decode(&v)
	if v.FirecrackerVersion != "1.11.0" {
		t.Errorf("version %q", v.FirecrackerVersion)
	}
	// A snapshot of another release line does not load.
	f := newFake(t, Options{Version: "1.16.1"})
	f.configure()
	f.must("PUT", "/actions", `{"action_type":"InstanceStart"}`)
	f.must("PATCH", "/vm", `{"state":"Paused"}`)
	f.must("PUT", "/snapshot/create", `{"snapshot_path":"s","mem_file_path":"m"}`)
	g := newFake(t, Options{Version: "1.15.1"})
	for _, name := range []string{"s", "m"} {
		os.Link(filepath.Join(f.dir, name), filepath.Join(g.dir, name))
	}
	g.refused("PUT", "/snapshot/load", `{"snapshot_path":"s","mem_backend":{"backend_type":"File","backend_path":"m"}}`, "unsupported snapshot version")
}

// TestHybridVsock: CONNECT to the agent's port is answered OK and bridged to the guest;
// other ports are closed; a paused guest holds the request until it resumes; a snapshot
// resets established connections.
func TestHybridVsock(t *testing.T) {
	guestDir := t.TempDir()
	agentSock := filepath.Join(guestDir, "agent.sock")
	ln, err := net.Listen("unix", agentSock)
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
					fmt.Fprintf(c, "echo %s\n", sc.Text())
				}
			}()
		}
	}()
	f := newFake(t, Options{Guest: DialUnixGuest(agentSock)})
	f.configure()
	vsock := filepath.Join(f.dir, "v.sock")
	connect := func(port int) (net.Conn, *bufio.Reader, string) {
		t.Helper()
		c, err := net.Dial("unix", vsock)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(c, "CONNECT %d\n", port)
		br := bufio.NewReader(c)
		line, _ := br.ReadString('\n')
		return c, br, line
	}
	// Before boot nothing listens.
	c, _, line := connect(1024)
	c.Close()
	if line != "" {
		t.Errorf("answer before boot: %q", line)
	}
	f.must("PUT", "/actions", `{"action_type":"InstanceStart"}`)
	c, _, line = connect(1025)
	c.Close()
	if line != "" {
		t.Errorf("answer for a port nothing listens on: %q", line)
	}
	c, br, line := connect(1024)
	if !strings.HasPrefix(line, "OK ") {
		t.Fatalf("CONNECT 1024: %q", line)
	}
	fmt.Fprintln(c, "hi")
	if got, _ := br.ReadString('\n'); got != "echo hi\n" {
		t.Errorf("bridged answer %q", got)
	}
	f.must("PATCH", "/vm", `{"state":"Paused"}`)
	pending := make(chan string, 1)
	go func() {
		c2, br2, line := connect(1024)
		defer c2.Close()
		if strings.HasPrefix(line, "OK ") {
			fmt.Fprintln(c2, "later")
			line, _ = br2.ReadString('\n')
		}
		pending <- line
	}()
	f.must("PUT", "/snapshot/create", `{"snapshot_path":"s","mem_file_path":"m"}`)
	if _, err := br.ReadString('\n'); err == nil {
		t.Error("connection survived the snapshot")
	}
	c.Close()
	f.must("PATCH", "/vm", `{"state":"Resumed"}`)
	select {
	case got := <-pending:
		if got != "echo later\n" {
			t.Errorf("connection requested while paused: %q", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("connection requested while paused never completed")
	}
}

// TestJailedAccess: with a chroot and a uid, paths resolve inside the chroot (".." stops
// at its root) and files the uid may not use are refused as Firecracker would find them.
func TestJailedAccess(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (files owned by another uid)")
	}
	root := t.TempDir()
	os.Chmod(root, 0o755)
	f := newFake(t, Options{})
	srv, err := New(Options{Root: root, CheckAccess: true, UID: 4242, GID: 4242})
	if err != nil {
		t.Fatal(err)
	}
	f.srv = srv
	write := func(name string, mode os.FileMode, uid int) {
		p := filepath.Join(root, name)
		os.WriteFile(p, []byte("\x7fELF"), mode)
		os.Chmod(p, mode)
		os.Chown(p, uid, uid)
	}
	write("vmlinux", 0o644, 0)
	write("disk-root", 0o600, 0)
	write("disk-mine", 0o600, 4242)
	for _, c := range []struct {
		path  string
		write bool
		ok    bool
	}{
		{"/vmlinux", false, true},
		{"../../vmlinux", false, true}, // resolves to <root>/vmlinux
		{"vmlinux", true, false},
		{"disk-root", true, false},
		{"disk-mine", true, true},
	} {
		err := srv.openable(c.path, c.write)
		if (err == nil) != c.ok {
			t.Errorf("open %s (write %v): %v, want ok=%v", c.path, c.write, err, c.ok)
		}
	}
	if got := srv.hostPath("/run/../../etc/passwd"); got != filepath.Join(root, "etc/passwd") {
		t.Errorf("hostPath escaped the chroot: %s", got)
	}
}
