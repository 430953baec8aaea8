package server_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// The node verbs over HTTP: list shows capacity and usage; cordon and uncordon; rm
// refuses a live uncordoned node or one that holds sandboxes, removes an empty
// cordoned one, and frees its name for a replacement.
func TestNodeVerbs(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) {
		c.Capacity = store.Resources{CPU: 4, MemoryMB: 2048, DiskMB: 8192}
	}})
	sb := s.Create(api.CreateSandboxRequest{CPU: 1, MemoryMB: 512})
	nodes, err := s.C.ListNodes(ctx(t))
	if err != nil || len(nodes) != 1 {
		t.Fatalf("nodes %+v %v", nodes, err)
	}
	n := nodes[0]
	if n.Capacity != (api.NodeResources{CPU: 4, MemoryMB: 2048, DiskMB: 8192}) || n.Used.CPU != 1 || n.Used.MemoryMB != 512 ||
		n.Used.DiskMB < store.NodeDiskFloorMB || n.Sandboxes != 1 || n.Cordoned {
		t.Fatalf("node %+v", n)
	}

	if code, body := do(t, s, "DELETE", "/v1/nodes/"+n.Name, ""); code != http.StatusConflict || !strings.Contains(body, "not cordoned") {
		t.Fatalf("rm of a live node: %d %s", code, body)
	}
	if code, body := do(t, s, "DELETE", "/v1/nodes/nosuch", ""); code != http.StatusNotFound {
		t.Fatalf("rm of an unknown node: %d %s", code, body)
	}
	if code, body := do(t, s, "POST", "/v1/nodes/nosuch/cordon", ""); code != http.StatusNotFound {
		t.Fatalf("cordon of an unknown node: %d %s", code, body)
	}
	c, err := s.C.CordonNode(ctx(t), n.Name, true)
	if err != nil || !c.Cordoned || c.Name != n.Name {
		t.Fatalf("cordon: %+v %v", c, err)
	}
	if code, body := do(t, s, "DELETE", "/v1/nodes/"+n.Name, ""); code != http.StatusConflict || !strings.Contains(body, "holds 1 sandbox") {
		t.Fatalf("rm of a cordoned node with a sandbox: %d %s", code, body)
	}
	if c, err := s.C.CordonNode(ctx(t), n.ID, false); err != nil || c.Cordoned {
		t.Fatalf("uncordon: %+v %v", c, err)
	}
	del, err := s.C.DeleteSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(del.ID, api.OpSucceeded)

	// Empty and cordoned: removable (its process is stopped first, as the docs say).
	s.StopNode()
	if _, err := s.C.CordonNode(ctx(t), n.Name, true); err != nil {
		t.Fatal(err)
	}
	code, body := do(t, s, "DELETE", "/v1/nodes/"+n.Name, "")
	var rm api.RemovedNode
	if code != http.StatusOK || json.Unmarshal([]byte(body), &rm) != nil || rm.Node.ID != n.ID || rm.SandboxesDeleted != 0 {
		t.Fatalf("rm: %d %s", code, body)
	}
	if nodes, err := s.C.ListNodes(ctx(t)); err != nil || len(nodes) != 0 {
		t.Fatalf("nodes after rm: %+v %v", nodes, err)
	}
	// A replacement host registers under the freed name.
	if err := s.Store.RegisterNode(ctx(t), &store.Node{ID: "replacement", Name: n.Name, Runtime: "fake", DataPlaneURL: s.URL}); err != nil {
		t.Fatalf("replacement under the same name: %v", err)
	}
}
