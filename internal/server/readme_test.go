package server_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/spacetest"
)

// TestReadmeCurl runs the README's HTTP example exactly as written — the sh block
// after "The same over HTTP" — with bash, curl and jq against an in-process space,
// the operator key in SPACE_DATA_DIR/admin.key and SPACE_URL pointing at the server.
func TestReadmeCurl(t *testing.T) {
	for _, tool := range []string{"bash", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (scripts/setup.sh installs it)", tool)
		}
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)The same over HTTP.*?```sh\n(.*?)```").FindSubmatch(readme)
	if m == nil {
		t.Fatal("README.md: no HTTP example after \"The same over HTTP\"")
	}
	script := string(m[1])
	s := spacetest.Start(t, spacetest.Options{})
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "admin.key"), []byte(s.AdminKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(c, "bash", "-euo", "pipefail", "-x", "-c", script)
	cmd.Env = append(os.Environ(), "SPACE_DATA_DIR="+dir, "SPACE_URL="+s.URL)
	out, err := cmd.CombinedOutput()
	text := string(out)
	if err != nil {
		t.Fatalf("the README's example failed: %v\n%s", err, text)
	}
	// Every request answered as the README says: the wait ends with the operation
	// done, the sandbox runs, the stream carries 1 2 3 and the exit, the delete is
	// accepted.
	for _, want := range []string{
		`"kind":"create"`, `"state":"succeeded"`, `"state":"running"`,
		"event: start", `"text":"1\n"`, `"text":"2\n"`, `"text":"3\n"`, "event: exit", `"exit_code":0`,
		`"text":"one-request\n"`, `"exit_code":3`,
		`"kind":"delete"`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the README's example printed no %q:\n%s", want, text)
		}
	}
	if strings.Contains(text, `"error"`) {
		t.Errorf("a request of the README's example failed:\n%s", text)
	}
}
