package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/testenv"
)

// TestSplitRoles runs the roles as separate processes sharing one PostgreSQL, as a
// fleet does: an api+controller process and a node process. The node learns its work
// from the database only; clients attach to the node's own data plane.
func TestSplitRoles(t *testing.T) {
	requireHost(t)
	db := testenv.Postgres(t)
	node := start(t, options{DBURL: db, Args: []string{"--roles", "node"}})
	apiSrv := start(t, options{DBURL: db, NoBase: true, Args: []string{"--roles", "api,controller"}})
	if apiSrv.Key == "" || node.Key != "" {
		t.Fatalf("only the api process creates the admin key (api %q, node %q)", apiSrv.Key, node.Key)
	}
	waitFor(t, time.Minute, "the node to register", func() bool {
		nodes, err := apiSrv.C.ListNodes(ctx(t, time.Minute))
		return err == nil && len(nodes) == 1 && nodes[0].State == "alive"
	})
	sb := apiSrv.create(t, api.CreateSandboxRequest{})
	sess, err := apiSrv.C.CreateSession(ctx(t, time.Minute), sb.ID, api.CreateSessionRequest{Argv: []string{"python3", "-c", "print(6*7)"}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(sess.AttachURL, node.URL+"/") {
		t.Fatalf("attach URL %s does not point at the node's data plane %s", sess.AttachURL, node.URL)
	}
	out, _, code := apiSrv.exec(t, sb.ID, "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("exec through the split roles: %d %q", code, out)
	}
	// The node serves no control plane.
	if code, _ := status(t, "GET", node.URL+"/v1/sandboxes", apiSrv.Key, nil); code != 404 {
		t.Fatalf("node-only process answered the control plane: %d", code)
	}
}
