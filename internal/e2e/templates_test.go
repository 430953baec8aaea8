package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	stdlog "log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
)

// toolSource is a tiny static multi-call program: the only executable of the test
// images (no shell, no libc). Called as sh -c "LINE" it runs LINE's words, so the
// shell form of run steps works too.
const toolSource = `package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	args := os.Args[1:]
	if filepath.Base(os.Args[0]) == "sh" {
		if len(args) != 2 || args[0] != "-c" {
			fmt.Fprintln(os.Stderr, "usage: sh -c LINE")
			os.Exit(2)
		}
		args = strings.Fields(args[1])
		if len(args) > 0 && filepath.Base(args[0]) == "tool" {
			args = args[1:]
		}
	}
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, "usage: tool COMMAND ARGS")
		os.Exit(2)
	}
	switch a := args[1:]; args[0] {
	case "echo":
		fmt.Println(strings.Join(a, " "))
	case "write":
		check(os.WriteFile(a[0], []byte(a[1]+"\n"), 0o644))
	case "cat":
		f, err := os.Open(a[0])
		check(err)
		_, err = io.Copy(os.Stdout, f)
		check(err)
	case "env":
		fmt.Println(os.Getenv(a[0]))
	case "report":
		wd, _ := os.Getwd()
		fmt.Printf("uid=%d cwd=%s STEP_VAR=%s FROM_IMAGE=%s\n", os.Getuid(), wd, os.Getenv("STEP_VAR"), os.Getenv("FROM_IMAGE"))
	case "stat":
		fi, err := os.Stat(a[0])
		check(err)
		fmt.Printf("%o %d\n", fi.Mode().Perm(), fi.Sys().(*syscall.Stat_t).Uid)
	case "fail":
		fmt.Fprintln(os.Stderr, "about to fail")
		n, _ := strconv.Atoi(a[0])
		os.Exit(n)
	case "sleep":
		fmt.Println("sleeping")
		d, err := time.ParseDuration(a[0])
		check(err)
		time.Sleep(d)
	default:
		fmt.Fprintln(os.Stderr, "unknown command", args[0])
		os.Exit(2)
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
`

var toolOnce struct {
	sync.Once
	bin []byte
	err error
}

// toolBinary builds toolSource once (CGO_ENABLED=0: static).
func toolBinary(t testing.TB) []byte {
	t.Helper()
	toolOnce.Do(func() {
		dir, err := os.MkdirTemp("", "space-tool-")
		if err != nil {
			toolOnce.err = err
			return
		}
		defer os.RemoveAll(dir)
		for n, c := range map[string]string{"go.mod": "module example.com/tool\n\ngo 1.22\n", "main.go": toolSource} {
			if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
				toolOnce.err = err
				return
			}
		}
		cmd := exec.Command("go", "build", "-o", "tool.bin", ".")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=")
		if out, err := cmd.CombinedOutput(); err != nil {
			toolOnce.err = fmt.Errorf("build tool: %v\n%s", err, out)
			return
		}
		toolOnce.bin, toolOnce.err = os.ReadFile(filepath.Join(dir, "tool.bin"))
	})
	if toolOnce.err != nil {
		t.Fatal(toolOnce.err)
	}
	return toolOnce.bin
}

// tarEntry is one entry of a test layer.
type tarEntry struct {
	name, link string
	typ        byte
	mode       int64
	uid        int
	body       []byte
}

func layerOf(t testing.TB, entries ...tarEntry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.uid,
			Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0)}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// helloImage is a tiny image: the tool as /bin/tool and /bin/sh, a passwd with root
// and app (uid 1000), and an image config (env, workdir, user, entrypoint + cmd).
func helloImage(t testing.TB) v1.Image {
	tool := toolBinary(t)
	base := layerOf(t,
		tarEntry{name: "bin/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "bin/tool", typ: tar.TypeReg, mode: 0o755, body: tool},
		tarEntry{name: "bin/sh", typ: tar.TypeSymlink, link: "tool"},
		tarEntry{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "etc/passwd", typ: tar.TypeReg, body: []byte("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")},
		tarEntry{name: "etc/group", typ: tar.TypeReg, body: []byte("root:x:0:\napp:x:1000:\n")},
		tarEntry{name: "home/app/", typ: tar.TypeDir, mode: 0o755, uid: 1000},
		tarEntry{name: "root/", typ: tar.TypeDir, mode: 0o700},
	)
	// A second layer: a file that the first layer does not have, and a whiteout.
	top := layerOf(t,
		tarEntry{name: "etc/greeting", typ: tar.TypeReg, body: []byte("hello from the image\n")},
		tarEntry{name: "etc/.wh.group", typ: tar.TypeReg},
	)
	img, err := mutate.AppendLayers(empty.Image, base, top)
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.Config(img, v1.Config{
		Env:        []string{"PATH=/bin", "FROM_IMAGE=1"},
		WorkingDir: "/home/app",
		User:       "app:app",
		Entrypoint: []string{"/bin/tool"},
		Cmd:        []string{"sleep", "1h"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// writeArchive writes img as a docker-archive tarball (docker save format).
func writeArchive(t testing.TB, path string, img v1.Image) {
	t.Helper()
	tag, err := name.NewTag("registry.example.com/test/hello:v1")
	if err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(path, tag, img); err != nil {
		t.Fatal(err)
	}
}

// apiCall makes a control-plane request and decodes a JSON answer into out (if not
// nil); it returns the status and the raw body.
func (s *srv) apiCall(t testing.TB, method, path, ctype string, body []byte, out any) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx(t, time.Minute), method, s.URL+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+s.Key)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if out != nil && resp.StatusCode < 300 {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: decode %s: %v", method, path, b, err)
		}
	}
	return resp.StatusCode, string(b)
}

// postBuild submits a spec, retrying while the node has not started its builder yet
// (503), and returns the status and body of the last answer.
func (s *srv) postBuild(t testing.TB, ctype, spec string) (int, string, *api.Operation) {
	t.Helper()
	var op api.Operation
	var code int
	var body string
	waitFor(t, time.Minute, "a node that builds templates", func() bool {
		code, body = s.apiCall(t, "POST", "/v1/templates", ctype, []byte(spec), &op)
		return code != http.StatusServiceUnavailable
	})
	return code, body, &op
}

// build submits a spec that must be accepted and waits for its operation.
func (s *srv) build(t testing.TB, spec string) *api.Operation {
	t.Helper()
	code, body, op := s.postBuild(t, "application/yaml", spec)
	if code != http.StatusAccepted {
		t.Fatalf("build: %d %s", code, body)
	}
	done, err := s.C.WaitOperation(ctx(t, 3*time.Minute), op.ID)
	if err != nil {
		t.Fatal(err)
	}
	return done
}

// opLog returns an operation's log lines.
func (s *srv) opLog(t testing.TB, id string) string {
	t.Helper()
	var out struct {
		Lines []struct{ Line string } `json:"lines"`
	}
	if code, body := s.apiCall(t, "GET", "/v1/operations/"+id+"/log", "", nil, &out); code != 200 {
		t.Fatalf("log: %d %s", code, body)
	}
	var b strings.Builder
	for _, l := range out.Lines {
		b.WriteString(l.Line + "\n")
	}
	return b.String()
}

type templateInfo struct {
	Name     string            `json:"name"`
	Tags     map[string]string `json:"tags"`
	Releases []struct {
		Ref    string   `json:"ref"`
		Digest string   `json:"digest"`
		Tags   []string `json:"tags"`
		Config struct {
			Env     map[string]string `json:"env"`
			User    string            `json:"user"`
			Workdir string            `json:"workdir"`
			Start   []string          `json:"start"`
			CPU     int               `json:"cpu"`
		} `json:"config"`
		Nodes []string `json:"nodes"`
	} `json:"releases"`
}

func (s *srv) template(t testing.TB, name string) (int, *templateInfo) {
	t.Helper()
	var ti templateInfo
	code, _ := s.apiCall(t, "GET", "/v1/templates/"+name, "", nil, &ti)
	return code, &ti
}

// storeEntries lists a directory of the server's btrfs store.
func (s *srv) storeEntries(t testing.TB, dir string) []string {
	t.Helper()
	return dirNames(t, filepath.Join(s.DataDir, "store", dir))
}

// buildOps counts the template build operations in the database.
func (s *srv) buildOps(t testing.TB) int {
	t.Helper()
	conn, err := pgx.Connect(ctx(t, time.Minute), s.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(ctx(t, time.Minute), `SELECT count(*) FROM operations WHERE kind='template_build'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestTemplates builds templates from a docker-archive tarball made here (with run and
// copy steps), from a registry, from a directory and from another template; creates
// sandboxes from name:tag and name@sha256; checks failing builds, the allowlist,
// strict specs, moving tags and deleting releases.
func TestTemplates(t *testing.T) {
	requireHost(t)
	began := time.Now()
	work := t.TempDir()
	allowed := filepath.Join(work, "allowed")
	outside := filepath.Join(work, "outside")
	for _, d := range []string{filepath.Join(allowed, "files", "tree", "sub"), outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	img := helloImage(t)
	archive := filepath.Join(allowed, "hello.tar")
	writeArchive(t, archive, img)
	writeArchive(t, filepath.Join(outside, "hello.tar"), img)
	for p, c := range map[string]string{
		"files/data.txt":      "copied data\n",
		"files/tree/sub/leaf": "leaf\n",
		"files/tree/top":      "top\n",
	} {
		if err := os.WriteFile(filepath.Join(allowed, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A link inside the allowed directory that leads out of it.
	if err := os.Symlink(outside, filepath.Join(allowed, "escape")); err != nil {
		t.Fatal(err)
	}
	// A registry on loopback holding the same image.
	reg := httptest.NewServer(registry.New(registry.Logger(stdlog.New(io.Discard, "", 0))))
	defer reg.Close()
	regHost := strings.TrimPrefix(reg.URL, "http://")
	pushed := regHost + "/test/hello:v1"
	ref, err := name.ParseReference(pushed)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}

	s := start(t, options{NoBase: true, Args: []string{"--template-sources", "dir:" + allowed + ",registry:" + regHost + "/test"}})
	t.Logf("setup took %s", time.Since(began).Round(time.Millisecond))

	// Build hello:v1 with the CLI, streaming the log.
	specFile := filepath.Join(work, "hello.yaml")
	helloSpec := fmt.Sprintf(`name: hello
tag: v1
from:
  archive: %s
steps:
  - run: tool write /etc/built yes
  - run: [/bin/tool, report]
    user: app
    workdir: /home/app
    env: {STEP_VAR: from-step}
  - copy: {src: %s/files/data.txt, dst: /opt/data/, mode: "0640", user: app}
  - copy: {src: %s/files/tree, dst: /opt/tree}
config:
  env: {FROM_SPEC: "2"}
  workdir: /opt
  cpu: 1
`, archive, allowed, allowed)
	if err := os.WriteFile(specFile, []byte(helloSpec), 0o644); err != nil {
		t.Fatal(err)
	}
	// The node publishes its allowlist when its builder starts: until then the API
	// has no node to build on (503); then a source outside it is refused (403).
	waitFor(t, time.Minute, "a node that builds templates", func() bool {
		code, _ := s.apiCall(t, "POST", "/v1/templates", "application/yaml", []byte("name: probe\nfrom: {dir: "+outside+"}\n"), nil)
		return code == http.StatusForbidden
	})
	t0 := time.Now()
	out, errOut, code := s.cli(t, "template", "build", "-f", specFile)
	if code != 0 {
		t.Fatalf("template build: exit %d\n%s\n%s", code, out, errOut)
	}
	t.Logf("archive build with 4 steps took %s", time.Since(t0).Round(time.Millisecond))
	for _, want := range []string{"step 1/4: run: tool write /etc/built yes", "uid=1000 cwd=/home/app STEP_VAR=from-step FROM_IMAGE=1",
		"extracted", "copied /opt/data/data.txt", "built hello:v1: sha256:"} {
		if !strings.Contains(out, want) {
			t.Errorf("build output lacks %q:\n%s", want, out)
		}
	}
	code, hello := s.template(t, "hello")
	if code != 200 || len(hello.Releases) != 1 {
		t.Fatalf("GET hello: %d %+v", code, hello)
	}
	digest1 := hello.Tags["v1"]
	rel := hello.Releases[0]
	if rel.Digest != digest1 || rel.Ref != "hello@"+digest1 || len(rel.Nodes) != 1 {
		t.Errorf("release %+v, tags %v", rel, hello.Tags)
	}
	c := rel.Config
	if c.Env["FROM_IMAGE"] != "1" || c.Env["FROM_SPEC"] != "2" || c.Env["PATH"] != "/bin" || c.User != "app" ||
		c.Workdir != "/opt" || strings.Join(c.Start, " ") != "/bin/tool sleep 1h" || c.CPU != 1 {
		t.Errorf("config = %+v", c)
	}

	// Sandboxes from name:tag and from name@sha256.
	byTag := s.create(t, api.CreateSandboxRequest{Template: "hello:v1"})
	byDigest := s.create(t, api.CreateSandboxRequest{Template: "hello@" + digest1})
	for _, sb := range []*api.Sandbox{byTag, byDigest} {
		if sb.TemplateDigest != digest1 {
			t.Errorf("sandbox %s (%s): digest %s, want %s", sb.ID, sb.Template, sb.TemplateDigest, digest1)
		}
		for _, tc := range []struct {
			argv []string
			want string
		}{
			{[]string{"/bin/tool", "cat", "/etc/built"}, "yes\n"},
			{[]string{"/bin/tool", "cat", "/etc/greeting"}, "hello from the image\n"},
			{[]string{"/bin/tool", "stat", "/opt/data/data.txt"}, "640 1000\n"},
			{[]string{"/bin/tool", "cat", "/opt/tree/sub/leaf"}, "leaf\n"},
			{[]string{"/bin/tool", "env", "FROM_SPEC"}, "2\n"},
		} {
			out, errb, code := s.exec(t, sb.ID, tc.argv...)
			if code != 0 || out != tc.want {
				t.Errorf("sandbox from %s: %v = %d %q %q, want %q", sb.Template, tc.argv, code, out, errb, tc.want)
			}
		}
		if out, _, code := s.exec(t, sb.ID, "/bin/tool", "cat", "/etc/group"); code == 0 {
			t.Errorf("/etc/group survived its whiteout: %q", out)
		}
	}

	// A failing step: the operation fails with the step's output in its log; no release.
	t0 = time.Now()
	badSpec := fmt.Sprintf(`{"name": "hello-bad", "from": {"archive": %q}, "steps": [{"run": "tool echo before"}, {"run": ["/bin/tool", "fail", "3"]}, {"run": "tool echo never"}]}`, archive)
	code, body, op := s.postBuild(t, "application/json", badSpec)
	if code != http.StatusAccepted {
		t.Fatalf("bad build: %d %s", code, body)
	}
	done, err := s.C.WaitOperation(ctx(t, 2*time.Minute), op.ID)
	if err != nil {
		t.Fatal(err)
	}
	if done.State != api.OpFailed || !strings.Contains(done.Error, "step 2") || !strings.Contains(done.Error, "exited with code 3") {
		t.Errorf("failed build op: %+v", done)
	}
	log := s.opLog(t, op.ID)
	if !strings.Contains(log, "about to fail") || !strings.Contains(log, "before") || strings.Contains(log, "never") {
		t.Errorf("failed build log:\n%s", log)
	}
	if code, _ := s.template(t, "hello-bad"); code != 404 {
		t.Errorf("GET hello-bad after a failed build: %d", code)
	}
	if tmp := s.storeEntries(t, "tmp"); len(tmp) != 0 {
		t.Errorf("store tmp after a failed build: %v", tmp)
	}
	t.Logf("failing build took %s", time.Since(t0).Round(time.Millisecond))

	// Strict specs: 400, nothing queued.
	before := s.buildOps(t)
	for _, tc := range []struct{ ctype, spec, want string }{
		{"application/yaml", "name: x\nfrom: {archive: " + archive + "}\nstepz: []\n", `stepz`},
		{"application/json", `{"name": "x", "from": {"archive": "/a", "dir": "/b"}}`, "exactly one source"},
		{"application/json", `{"name": "x", "from": {"dir": "/b"}, "steps": [{"copy": {"src": "/a", "dst": "/b"}, "env": {"A": "1"}}]}`, "belong to run steps"},
		{"application/json", `{"name": "x",`, "spec:"},
		{"text/plain", "name: x\nfrom: {dir: /b}\n", "Content-Type"},
		{"application/yaml", "", "empty"},
	} {
		code, body := s.apiCall(t, "POST", "/v1/templates", tc.ctype, []byte(tc.spec), nil)
		if code != http.StatusBadRequest || !strings.Contains(body, tc.want) {
			t.Errorf("spec %q: %d %s, want 400 with %q", tc.spec, code, body, tc.want)
		}
	}
	// Sources the node does not allow: 403 naming the setting, nothing queued or written.
	for _, spec := range []string{
		fmt.Sprintf("name: x\nfrom: {archive: %s/hello.tar}\n", outside),
		fmt.Sprintf("name: x\nfrom: {archive: %s/escape/hello.tar}\n", allowed),
		fmt.Sprintf("name: x\nfrom: {archive: %s/../outside/hello.tar}\n", allowed),
		fmt.Sprintf("name: x\nfrom: {dir: %s}\n", outside),
		"name: x\nfrom: {image: registry.example.com/test/hello:v1}\n",
		fmt.Sprintf("name: x\nfrom: {image: %s/other/hello:v1}\n", regHost),
		fmt.Sprintf("name: x\nfrom: {archive: %s}\nsteps: [{copy: {src: /etc/shadow, dst: /x}}]\n", archive),
	} {
		code, body := s.apiCall(t, "POST", "/v1/templates", "application/yaml", []byte(spec), nil)
		if code != http.StatusForbidden || !strings.Contains(body, "--template-sources") {
			t.Errorf("spec %q: %d %s, want 403 naming --template-sources", spec, code, body)
		}
	}
	if code, body := s.apiCall(t, "POST", "/v1/templates", "application/yaml", []byte("name: x\nfrom: {template: nothere:v9}\n"), nil); code != 404 {
		t.Errorf("unknown parent template: %d %s", code, body)
	}
	if after := s.buildOps(t); after != before {
		t.Errorf("refused specs queued %d build operations", after-before)
	}
	if tmp := s.storeEntries(t, "tmp"); len(tmp) != 0 {
		t.Errorf("store tmp after refused specs: %v", tmp)
	}

	// Malicious archives: an entry climbing out with "..", and a file in an upper layer
	// under a directory that a lower layer makes an absolute symbolic link out. Both
	// builds fail and nothing appears outside.
	for i, layers := range [][]v1.Layer{
		{layerOf(t, tarEntry{name: "../../../" + filepath.Base(outside) + "/pwned", typ: tar.TypeReg, body: []byte("pwned")})},
		{
			layerOf(t, tarEntry{name: "evil", typ: tar.TypeSymlink, link: outside}),
			layerOf(t, tarEntry{name: "evil/pwned", typ: tar.TypeReg, body: []byte("pwned")}),
		},
	} {
		evilImg, err := mutate.AppendLayers(empty.Image, layers...)
		if err != nil {
			t.Fatal(err)
		}
		evil := filepath.Join(allowed, fmt.Sprintf("evil%d.tar", i))
		writeArchive(t, evil, evilImg)
		done := s.build(t, fmt.Sprintf("name: evil%d\nfrom: {archive: %s}\n", i, evil))
		if done.State != api.OpFailed {
			t.Errorf("malicious archive %d: %+v", i, done)
		}
		t.Logf("malicious archive %d: %s %s", i, done.State, done.Error)
		if ents, _ := os.ReadDir(outside); len(ents) != 1 {
			t.Fatalf("a malicious archive wrote outside the root filesystem: %v", ents)
		}
	}

	// Moving the tag: a second build of hello:v1 with other content.
	t0 = time.Now()
	done = s.build(t, strings.Replace(helloSpec, "steps:\n", "steps:\n  - run: tool write /etc/version 2\n", 1))
	if done.State != api.OpSucceeded {
		t.Fatalf("second build: %+v\n%s", done, s.opLog(t, done.ID))
	}
	t.Logf("second build took %s", time.Since(t0).Round(time.Millisecond))
	_, hello = s.template(t, "hello")
	digest2 := hello.Tags["v1"]
	if digest2 == digest1 || len(hello.Releases) != 2 || !strings.Contains(done.Message, digest2) {
		t.Fatalf("after the second build: tags %v, %d releases, op %q", hello.Tags, len(hello.Releases), done.Message)
	}
	moved := s.create(t, api.CreateSandboxRequest{Template: "hello:v1"})
	if moved.TemplateDigest != digest2 {
		t.Errorf("new sandbox from hello:v1: digest %s, want %s", moved.TemplateDigest, digest2)
	}
	if out, _, _ := s.exec(t, moved.ID, "/bin/tool", "cat", "/etc/version"); out != "2\n" {
		t.Errorf("new sandbox /etc/version = %q", out)
	}
	old, err := s.C.GetSandbox(ctx(t, time.Minute), byTag.ID)
	if err != nil || old.TemplateDigest != digest1 || old.State != api.StateRunning {
		t.Errorf("old sandbox after the tag moved: %+v %v", old, err)
	}
	if _, _, code := s.exec(t, byTag.ID, "/bin/tool", "cat", "/etc/version"); code == 0 {
		t.Error("the old sandbox sees the new release")
	}

	// Deleting the old release: refused while sandboxes use it, allowed after.
	code, body = s.apiCall(t, "DELETE", "/v1/templates/hello@"+digest1, "", nil, nil)
	if code != http.StatusConflict || !strings.Contains(body, byTag.ID) {
		t.Errorf("delete a release in use: %d %s", code, body)
	}
	for _, sb := range []*api.Sandbox{byTag, byDigest} {
		op, err := s.C.DeleteSandbox(ctx(t, time.Minute), sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.C.WaitOperation(ctx(t, time.Minute), op.ID); err != nil {
			t.Fatal(err)
		}
	}
	out, errOut, code = s.cli(t, "template", "rm", "hello@"+digest1)
	if code != 0 || !strings.Contains(out, "deleted release hello@"+digest1) {
		t.Fatalf("template rm release: %d %s %s", code, out, errOut)
	}
	hex1 := strings.TrimPrefix(digest1, "sha256:")
	waitFor(t, 30*time.Second, "the node to remove the deleted release's files", func() bool {
		_, err := os.Stat(filepath.Join(s.DataDir, "store", "templates", hex1))
		return os.IsNotExist(err)
	})
	if code, _ := s.apiCall(t, "POST", "/v1/sandboxes", "application/json", []byte(`{"template": "hello@`+digest1+`"}`), nil); code != 404 {
		t.Errorf("create from a deleted release: %d", code)
	}
	// Removing the tag leaves the release, reachable by digest.
	out, errOut, code = s.cli(t, "template", "rm", "hello:v1")
	if code != 0 || !strings.Contains(out, "removed tag hello:v1") {
		t.Fatalf("template rm tag: %d %s %s", code, out, errOut)
	}
	out, _, code = s.cli(t, "template", "get", "hello", "-o", "json")
	var got templateInfo
	if code != 0 || json.Unmarshal([]byte(out), &got) != nil || len(got.Tags) != 0 || len(got.Releases) != 1 || got.Releases[0].Digest != digest2 {
		t.Errorf("template get after rm: %d %s", code, out)
	}
	if code, _ := s.apiCall(t, "POST", "/v1/sandboxes", "application/json", []byte(`{"template": "hello:v1"}`), nil); code != 404 {
		t.Errorf("create from a removed tag: %d", code)
	}
	if code, body := s.apiCall(t, "DELETE", "/v1/templates/hello:v1", "", nil, nil); code != 404 {
		t.Errorf("remove a missing tag: %d %s", code, body)
	}

	// From a registry (image config as defaults), then a template on top of it, then a
	// plain directory.
	t0 = time.Now()
	if done := s.build(t, "name: pulled\ntag: \"1\"\nfrom: {image: "+pushed+"}\n"); done.State != api.OpSucceeded {
		t.Fatalf("registry build: %+v\n%s", done, s.opLog(t, done.ID))
	} else if log := s.opLog(t, done.ID); !strings.Contains(log, "pulling "+pushed) || !strings.Contains(log, "2 layers") {
		t.Errorf("registry build log:\n%s", log)
	}
	done = s.build(t, "name: child\nfrom: {template: pulled:1}\nsteps: [{run: tool write /etc/child yes}]\nconfig: {env: {CHILD: \"1\"}}\n")
	if done.State != api.OpSucceeded {
		t.Fatalf("template build: %+v\n%s", done, s.opLog(t, done.ID))
	}
	_, child := s.template(t, "child")
	if cc := child.Releases[0].Config; cc.User != "app" || cc.Env["FROM_IMAGE"] != "1" || cc.Env["CHILD"] != "1" {
		t.Errorf("child config = %+v", cc)
	}
	sb := s.create(t, api.CreateSandboxRequest{Template: "child"})
	if out, _, _ := s.exec(t, sb.ID, "/bin/tool", "cat", "/etc/child"); out != "yes\n" {
		t.Errorf("child /etc/child = %q", out)
	}
	if done := s.build(t, "name: plain\nfrom: {dir: "+filepath.Join(allowed, "files")+"}\n"); done.State != api.OpSucceeded {
		t.Fatalf("dir build: %+v\n%s", done, s.opLog(t, done.ID))
	}
	t.Logf("registry, template and dir builds took %s", time.Since(t0).Round(time.Millisecond))

	out, _, code = s.cli(t, "template", "list", "-o", "json")
	var list []api.Template
	if code != 0 || json.Unmarshal([]byte(out), &list) != nil || len(list) != 4 {
		t.Errorf("template list: %d %s", code, out)
	}
	// A failing build through the CLI exits non-zero.
	if err := os.WriteFile(specFile, []byte(badSpec), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = s.cli(t, "template", "build", "-f", specFile)
	if code == 0 || !strings.Contains(out, "about to fail") || !strings.Contains(errOut, "exited with code 3") {
		t.Errorf("failing CLI build: exit %d\n%s\n%s", code, out, errOut)
	}
	out, _, code = s.cli(t, "template", "build", "-f", specFile, "--no-follow", "-o", "json")
	var queued api.Operation
	if code != 0 || json.Unmarshal([]byte(out), &queued) != nil || queued.Kind != api.OpTemplateBuild {
		t.Errorf("build --no-follow -o json: %d %s", code, out)
	}
	if _, err := s.C.WaitOperation(ctx(t, time.Minute), queued.ID); err != nil {
		t.Fatal(err)
	}
	t.Logf("TestTemplates took %s", time.Since(began).Round(time.Millisecond))
}

// TestTemplateBuildInterrupted kills space serve (SIGKILL) while a build step runs:
// after a restart the build operation has failed and nothing of the build is left: no
// release, no leftovers in the store's tmp/, no build sandbox.
func TestTemplateBuildInterrupted(t *testing.T) {
	requireHost(t)
	work := t.TempDir()
	archive := filepath.Join(work, "hello.tar")
	writeArchive(t, archive, helloImage(t))
	s := start(t, options{NoBase: true, Args: []string{"--template-sources", "dir:" + work}})
	code, body, op := s.postBuild(t, "application/yaml", "name: slow\nfrom: {archive: "+archive+"}\nsteps: [{run: tool sleep 300s}]\n")
	if code != http.StatusAccepted {
		t.Fatalf("build: %d %s", code, body)
	}
	waitFor(t, time.Minute, "the build step to run", func() bool { return strings.Contains(s.opLog(t, op.ID), "sleeping") })
	if tmp := s.storeEntries(t, "tmp"); len(tmp) == 0 {
		t.Fatal("no build in the store's tmp/ while building")
	}
	s.Kill()
	s.Restart()

	// The node fails the builds it was running when it stopped, once it has started.
	got, err := s.C.WaitOperation(ctx(t, time.Minute), op.ID)
	if err != nil || got.State != api.OpFailed || !strings.Contains(got.Error, "interrupted") {
		t.Fatalf("build operation after the restart: %+v %v", got, err)
	}
	if tmp := s.storeEntries(t, "tmp"); len(tmp) != 0 {
		t.Errorf("store tmp after the restart: %v", tmp)
	}
	if rels := s.storeEntries(t, "templates"); len(rels) != 0 {
		t.Errorf("releases after an interrupted build: %v", rels)
	}
	if code, _ := s.template(t, "slow"); code != 404 {
		t.Errorf("GET slow: %d", code)
	}
	waitFor(t, 30*time.Second, "the build sandbox to be reclaimed", func() bool { return len(s.runscIDs()) == 0 })
	// The node builds again after the restart.
	if done := s.build(t, "name: quick\nfrom: {archive: "+archive+"}\nsteps: [{run: tool echo ok}]\n"); done.State != api.OpSucceeded {
		t.Fatalf("build after restart: %+v\n%s", done, s.opLog(t, done.ID))
	}
}
