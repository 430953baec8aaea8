package codeinterp_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/codeinterp"
)

// ansi matches the terminal color codes of IPython's tracebacks.
var ansi = regexp.MustCompile("\x1b\\[[0-9;]*m")

// python is the interpreter with the Debian packages the template installs
// (scripts/setup.sh installs them on the host for this test).
const python = "/usr/bin/python3"

type server struct {
	url string
	hc  *http.Client
}

// startServer runs server.py on the host, as the template runs it in a sandbox.
func startServer(t *testing.T) *server {
	t.Helper()
	if err := exec.Command(python, "-c", "import jupyter_client, ipykernel").Run(); err != nil {
		t.Skip("needs python3-jupyter-client and python3-ipykernel (scripts/setup.sh installs them)")
	}
	dir := t.TempDir()
	script := filepath.Join(dir, "server.py")
	if err := os.WriteFile(script, codeinterp.Server, 0o644); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	home := filepath.Join(dir, "home")
	if err := os.Mkdir(home, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(python, script)
	cmd.Env = append(os.Environ(), "HOME="+home, "TMPDIR="+dir, fmt.Sprintf("SPACE_CODEINTERP_PORT=%d", port), "JUPYTER_RUNTIME_DIR="+filepath.Join(dir, "rt"))
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("server log:\n%s", logs.String())
		}
	})
	s := &server{url: fmt.Sprintf("http://127.0.0.1:%d", port), hc: &http.Client{}}
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := s.hc.Get(s.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("server not healthy: %v\n%s", err, logs.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// execution is what one /execute stream delivered.
type execution struct {
	stdout, stderr []string
	results        []map[string]any
	errors         []map[string]any
	count          float64
	ended          bool
}

func (e *execution) main() map[string]any {
	for _, r := range e.results {
		if r["is_main_result"] == true {
			return r
		}
	}
	return nil
}

func (s *server) run(t *testing.T, body map[string]any) *execution {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := s.hc.Post(s.url+"/execute", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		msg, _ := io.ReadAll(resp.Body)
		t.Fatalf("execute %v: %d %s", body, resp.StatusCode, msg)
	}
	ex := &execution{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("bad line %q: %v", sc.Text(), err)
		}
		switch m["type"] {
		case "stdout":
			ex.stdout = append(ex.stdout, m["text"].(string))
		case "stderr":
			ex.stderr = append(ex.stderr, m["text"].(string))
		case "result":
			ex.results = append(ex.results, m)
		case "error":
			ex.errors = append(ex.errors, m)
		case "number_of_executions":
			ex.count = m["execution_count"].(float64)
		case "end_of_execution":
			ex.ended = true
		}
	}
	if !ex.ended {
		t.Fatalf("execute %v: no end_of_execution", body)
	}
	return ex
}

func (s *server) call(t *testing.T, method, path string, body any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, s.url+path, rd)
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func TestPython(t *testing.T) {
	s := startServer(t)

	ex := s.run(t, map[string]any{"code": "1+1"})
	if m := ex.main(); m == nil || m["text"] != "2" || ex.count < 1 || len(ex.errors) != 0 {
		t.Errorf("1+1: %+v", ex)
	}
	ex = s.run(t, map[string]any{"code": "import sys\nprint('out'); print('err', file=sys.stderr)\nx = 41"})
	if strings.Join(ex.stdout, "") != "out\n" || strings.Join(ex.stderr, "") != "err\n" || ex.main() != nil {
		t.Errorf("print: %+v", ex)
	}
	// State persists in the default context.
	if ex = s.run(t, map[string]any{"code": "x + 1"}); ex.main()["text"] != "42" {
		t.Errorf("state: %+v", ex)
	}
	ex = s.run(t, map[string]any{"code": "'a string'"})
	if ex.main()["text"] != "a string" {
		t.Errorf("string result: %+v", ex.main())
	}
	// Errors come with name, value and traceback.
	ex = s.run(t, map[string]any{"code": "def f():\n    raise ValueError('bad value')\nf()"})
	if len(ex.errors) != 1 || ex.errors[0]["name"] != "ValueError" || ex.errors[0]["value"] != "bad value" ||
		!strings.Contains(ansi.ReplaceAllString(ex.errors[0]["traceback"].(string), ""), "raise ValueError('bad value')") {
		t.Errorf("error: %+v", ex.errors)
	}
	// Rich results: HTML and JSON displays, a matplotlib figure as PNG.
	ex = s.run(t, map[string]any{"code": "from IPython.display import display, HTML, JSON\ndisplay(HTML('<b>hi</b>'))\ndisplay(JSON({'a': 1}))"})
	if len(ex.results) != 2 || ex.results[0]["html"] != "<b>hi</b>" || ex.results[0]["is_main_result"] != false {
		t.Fatalf("displays: %+v %+v", ex.results, ex.errors)
	}
	if j, _ := ex.results[1]["json"].(map[string]any); j["a"] != float64(1) {
		t.Errorf("json display: %+v", ex.results[1])
	}
	if exec.Command(python, "-c", "import matplotlib").Run() == nil {
		ex = s.run(t, map[string]any{"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"})
		var png []byte
		for _, r := range ex.results {
			if p, ok := r["png"].(string); ok {
				png, _ = base64.StdEncoding.DecodeString(p)
			}
		}
		if !bytes.HasPrefix(png, []byte("\x89PNG")) {
			t.Errorf("matplotlib: no PNG result: %+v %+v", ex.results, ex.errors)
		}
	}
	// Environment variables for one execution only.
	ex = s.run(t, map[string]any{"code": "import os; os.environ.get('SPACE_T')", "env_vars": map[string]string{"SPACE_T": "v1"}})
	if ex.main()["text"] != "v1" {
		t.Errorf("env_vars: %+v", ex.main())
	}
	if ex = s.run(t, map[string]any{"code": "import os; os.environ.get('SPACE_T', 'unset')"}); ex.main()["text"] != "unset" {
		t.Errorf("env_vars leaked: %+v", ex.main())
	}

	// Contexts: separate state, cwd, list, restart, remove.
	code, b := s.call(t, "POST", "/contexts", map[string]any{"cwd": "/tmp"})
	var c struct{ ID, Language, Cwd string }
	if code != 200 || json.Unmarshal(b, &c) != nil || c.ID == "" || c.Language != "python" || c.Cwd != "/tmp" {
		t.Fatalf("create context: %d %s", code, b)
	}
	if ex = s.run(t, map[string]any{"code": "x", "context_id": c.ID}); len(ex.errors) != 1 || ex.errors[0]["name"] != "NameError" {
		t.Errorf("state crossed contexts: %+v", ex)
	}
	if ex = s.run(t, map[string]any{"code": "import os; y = 5; os.getcwd()", "context_id": c.ID}); ex.main()["text"] != "/tmp" {
		t.Errorf("cwd: %+v", ex.main())
	}
	code, b = s.call(t, "GET", "/contexts", nil)
	if code != 200 || !strings.Contains(string(b), c.ID) {
		t.Errorf("list: %d %s", code, b)
	}
	if code, b = s.call(t, "POST", "/contexts/"+c.ID+"/restart", nil); code != 200 {
		t.Fatalf("restart: %d %s", code, b)
	}
	if ex = s.run(t, map[string]any{"code": "y", "context_id": c.ID}); len(ex.errors) != 1 || ex.errors[0]["name"] != "NameError" {
		t.Errorf("restart kept state: %+v", ex)
	}
	if ex = s.run(t, map[string]any{"code": "import os; os.getcwd()", "context_id": c.ID}); ex.main()["text"] != "/tmp" {
		t.Errorf("cwd after restart: %+v", ex.main())
	}
	if code, b = s.call(t, "DELETE", "/contexts/"+c.ID, nil); code != 200 {
		t.Errorf("remove: %d %s", code, b)
	}
	for _, tc := range []struct {
		method, path string
		body         any
		status       int
	}{
		{"POST", "/execute", map[string]any{"code": "1", "context_id": c.ID}, 404},
		{"POST", "/contexts/" + c.ID + "/restart", nil, 404},
		{"DELETE", "/contexts/" + c.ID, nil, 404},
		{"POST", "/execute", map[string]any{"code": "1", "context_id": "x", "language": "python"}, 400},
		{"POST", "/execute", map[string]any{"code": "1", "language": "cobol"}, 400},
		{"POST", "/contexts", map[string]any{"cwd": "/does/not/exist"}, 400},
		{"GET", "/nope", nil, 404},
	} {
		if code, b := s.call(t, tc.method, tc.path, tc.body); code != tc.status {
			t.Errorf("%s %s %v: %d %s, want %d", tc.method, tc.path, tc.body, code, b, tc.status)
		}
	}

	// A client that goes away interrupts the execution; the context stays usable.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	b, _ = json.Marshal(map[string]any{"code": "import time\nfor i in range(300):\n    time.sleep(0.1)\nz = 'never'"})
	req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/execute", bytes.NewReader(b))
	if resp, err := s.hc.Do(req); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	start := time.Now()
	ex = s.run(t, map[string]any{"code": "globals().get('z', 'interrupted')"})
	if ex.main()["text"] != "interrupted" || time.Since(start) > 15*time.Second {
		t.Errorf("after an abandoned execution (%s): %+v", time.Since(start), ex)
	}
}

func TestBash(t *testing.T) {
	s := startServer(t)
	ex := s.run(t, map[string]any{"code": "echo hello; echo oops >&2; A=7; cd /tmp", "language": "bash"})
	if strings.Join(ex.stdout, "") != "hello\n" || strings.Join(ex.stderr, "") != "oops\n" || ex.count != 1 {
		t.Errorf("bash: %+v", ex)
	}
	ex = s.run(t, map[string]any{"code": "echo -n \"$A $(pwd) $E\"", "language": "bash", "env_vars": map[string]string{"E": "x y"}})
	if strings.Join(ex.stdout, "") != "7 /tmp x y" || ex.count != 2 {
		t.Errorf("bash state: %+v", ex)
	}
	if ex = s.run(t, map[string]any{"code": "echo \"[${E-unset}]\"", "language": "bash"}); strings.Join(ex.stdout, "") != "[unset]\n" {
		t.Errorf("bash env leaked: %+v", ex)
	}
	// exit ends the shell: an error, and a fresh shell next time.
	if ex = s.run(t, map[string]any{"code": "exit 3", "language": "bash"}); len(ex.errors) != 1 {
		t.Errorf("exit: %+v", ex)
	}
	if ex = s.run(t, map[string]any{"code": "echo \"${A-gone}\"", "language": "bash"}); strings.Join(ex.stdout, "") != "gone\n" {
		t.Errorf("after exit: %+v", ex)
	}
	// An abandoned execution is interrupted; the shell and its state remain.
	s.run(t, map[string]any{"code": "B=kept", "language": "bash"})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	b, _ := json.Marshal(map[string]any{"code": "sleep 60; B=late", "language": "bash"})
	req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/execute", bytes.NewReader(b))
	if resp, err := s.hc.Do(req); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	start := time.Now()
	if ex = s.run(t, map[string]any{"code": "echo $B", "language": "bash"}); strings.Join(ex.stdout, "") != "kept\n" || time.Since(start) > 10*time.Second {
		t.Errorf("after an abandoned execution (%s): %+v", time.Since(start), ex)
	}
}
