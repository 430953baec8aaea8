package cli_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/internal/cli"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// run runs the CLI with args against s and returns its standard output.
func run(t *testing.T, s *spacetest.Space, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	root := &cobra.Command{Use: "space", SilenceUsage: true, SilenceErrors: true}
	cli.AddCommands(root, &cli.Env{URL: s.URL, APIKey: s.AdminKey, Stdout: &out, Stderr: &errOut, Stdin: strings.NewReader("")})
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(&errOut)
	err := root.ExecuteContext(t.Context())
	return out.String(), err
}

func TestNodeCommands(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) { c.Capacity = store.Resources{MemoryMB: 4096} }})
	name := "node-" + s.NodeID[:6]
	s.Eventually(10*time.Second, "the node to register its capacity", func() bool {
		n, err := s.Store.GetNode(t.Context(), s.NodeID)
		return err == nil && n.Allocatable.MemoryMB == 4096
	})
	out, err := run(t, s, "node", "list")
	if err != nil || !strings.Contains(out, "CPU") || !strings.Contains(out, name) || !strings.Contains(out, "0/4096") ||
		!strings.Contains(out, "0/-") {
		t.Fatalf("node list: %v\n%s", err, out)
	}
	if !strings.Contains(out, "RELEASES") || !strings.Contains(out, "SNAPSHOTS") {
		t.Fatalf("node list shows no cache columns:\n%s", out)
	}
	for _, ref := range []string{name, s.NodeID} {
		out, err := run(t, s, "node", "show", ref)
		if err != nil || !strings.Contains(out, "id:          "+s.NodeID) || !strings.Contains(out, "memory:      0/4096 MiB") ||
			!strings.Contains(out, "releases:") {
			t.Fatalf("node show %s: %v\n%s", ref, err, out)
		}
	}
	if _, err := run(t, s, "node", "show", "nosuch"); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("node show of an unknown node: %v", err)
	}
	if out, err := run(t, s, "node", "cordon", name); err != nil || strings.TrimSpace(out) != name+" alive,cordoned" {
		t.Fatalf("cordon: %v %q", err, out)
	}
	if out, err := run(t, s, "node", "list", "-o", "json"); err != nil || !strings.Contains(out, `"cordoned": true`) ||
		!strings.Contains(out, `"memory_mb": 4096`) {
		t.Fatalf("node list -o json: %v\n%s", err, out)
	}
	if out, err := run(t, s, "node", "uncordon", name); err != nil || strings.TrimSpace(out) != name+" alive" {
		t.Fatalf("uncordon: %v %q", err, out)
	}
	if _, err := run(t, s, "node", "rm", name); err == nil || !strings.Contains(err.Error(), "not cordoned") {
		t.Fatalf("rm of a live node: %v", err)
	}
	s.StopNode()
	if _, err := run(t, s, "node", "cordon", name); err != nil {
		t.Fatal(err)
	}
	if out, err := run(t, s, "node", "rm", name); err != nil || !strings.Contains(out, "removed node "+name) {
		t.Fatalf("rm: %v %q", err, out)
	}
}
