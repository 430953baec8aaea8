package template_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/template"
)

func TestParseSpec(t *testing.T) {
	s, err := template.ParseSpec([]byte(`
name: web
from:
  archive: /srv/images/web.tar
steps:
  - run: make install
    user: app
    workdir: /src
    env: {CC: gcc}
    timeout: 10m
  - run: ["/usr/bin/env", "true"]
  - copy: {src: /srv/files/app.conf, dst: /etc/app/, mode: 0640, user: app}
config:
  env: {PORT: "8080"}
  user: app
  workdir: /srv
  start: ["/usr/bin/app", "--port", "8080"]
  cpu: 2
  memory_mb: 1024
  ready: {command: "curl -fs localhost:8080", timeout: 20s}
  warm: ["/usr/bin/app", "--check-config"]
`))
	if err != nil {
		t.Fatal(err)
	}
	if s.Tag != "latest" || s.Ref() != "web:latest" {
		t.Errorf("ref = %s", s.Ref())
	}
	if got := s.Steps[0].Run.Args(); strings.Join(got, "|") != "/bin/sh|-c|make install" {
		t.Errorf("shell form args = %q", got)
	}
	if got := s.Steps[1].Run.Args(); strings.Join(got, "|") != "/usr/bin/env|true" {
		t.Errorf("exec form args = %q", got)
	}
	if m := *s.Steps[2].Copy.Mode; m != 0o640 {
		t.Errorf("mode = %o", m)
	}
	if s.Config.Ready.Command.Shell == "" || s.Config.Ready.Timeout == 0 {
		t.Errorf("ready = %+v", s.Config.Ready)
	}
	if s.Config.Warm == nil || strings.Join(s.Config.Warm.Args(), "|") != "/usr/bin/app|--check-config" {
		t.Errorf("warm = %+v", s.Config.Warm)
	}
	// JSON round trip, as the spec travels in the build operation's params.
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := template.ParseSpec(b)
	if err != nil {
		t.Fatalf("re-parse %s: %v", b, err)
	}
	b2, _ := json.Marshal(s2)
	if string(b) != string(b2) {
		t.Errorf("round trip changed the spec:\n%s\n%s", b, b2)
	}
}

// TestParseSpecErrors: every mistake is a fault.Invalid whose message points at it.
func TestParseSpecErrors(t *testing.T) {
	for _, tc := range []struct{ spec, want string }{
		{`{"name": "x", "from": {"dir": "/d"}, "colour": "red"}`, `unknown field "colour"`},
		{"name: x\nfrom: {dir: /d, archive: /a}", "exactly one source"},
		{"name: x\nfrom: {}", "exactly one source"},
		{"from: {dir: /d}", "invalid template name"},
		{"name: X\nfrom: {dir: /d}", "invalid template name"},
		{"name: x:1\nfrom: {dir: /d}", "must not contain"},
		{"name: x\ntag: 'a b'\nfrom: {dir: /d}", "invalid template tag"},
		{"name: x\nfrom: {dir: relative}", "not an absolute path"},
		{"name: x\nfrom: {image: alpine}", "full reference"},
		{"name: x\nfrom: {template: 'Bad Ref'}", "from.template"},
		{"name: x\nfrom: {debian: {suite: 'bookworm; rm'}}", "suite"},
		{"name: x\nfrom: {debian: {suite: bookworm, packages: ['a,b']}}", "package name"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{}]", "needs run or copy"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{run: ''}]", "run is empty"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{run: true}]", "string or a list"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{run: ls, copy: {src: /a, dst: /b}}]", "not both"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{copy: {src: /a, dst: /b}, user: u}]", "belong to run steps"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{copy: {src: /a, dst: /b, mode: '999'}}]", "octal"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{copy: {src: /a, dst: b}}]", "copy.dst"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{run: ls, timeout: soon}]", "invalid duration"},
		{"name: x\nfrom: {dir: /d}\nsteps: [{run: ls, env: {'1X': y}}]", "env name"},
		{"name: x\nfrom: {dir: /d}\nconfig: {memory_mb: 10}", "memory_mb"},
		{"name: x\nfrom: {dir: /d}\nconfig: {workdir: here}", "workdir"},
		{"name: x\nfrom: {dir: /d}\nconfig: {start: 'not argv'}", "cannot unmarshal"},
		{"name: x\nfrom: {dir: /d}\nconfig: {warm: ''}", "warm is empty"},
		{"name: x\nname: y\nfrom: {dir: /d}", "already set"},
		{"- just\n- a list", "cannot unmarshal"},
	} {
		_, err := template.ParseSpec([]byte(tc.spec))
		if err == nil || !fault.Is(err, fault.Invalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseSpec(%q) = %v (kind %v), want invalid with %q", tc.spec, err, fault.KindOf(err), tc.want)
		}
	}
}

func TestConfigMerge(t *testing.T) {
	image := template.Config{Env: map[string]string{"PATH": "/bin", "A": "1"}, User: "app", Workdir: "/w", Start: []string{"/app"}}
	got := image.Merge(template.Config{Env: map[string]string{"A": "2", "B": "3"}, Workdir: "/x", CPU: 2})
	if got.Env["PATH"] != "/bin" || got.Env["A"] != "2" || got.Env["B"] != "3" || got.User != "app" ||
		got.Workdir != "/x" || got.Start[0] != "/app" || got.CPU != 2 {
		t.Fatalf("merge = %+v", got)
	}
	if image.Env["A"] != "1" {
		t.Fatal("merge changed its receiver")
	}
}
