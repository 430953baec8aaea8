package server_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/spacetest"
)

// The HTTP surface of named snapshots and metrics: status codes, the disk reserve,
// idempotent creates from a snapshot.
func TestSnapshotRoutes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	code, body := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/snapshots", `{"name":"http"}`)
	if code != 202 {
		t.Fatalf("create: %d %s", code, body)
	}
	var sn api.Snapshot
	if err := json.Unmarshal([]byte(body), &sn); err != nil || sn.Operation == nil || sn.State != api.SnapshotCreating {
		t.Fatalf("create answer: %s %v", body, err)
	}
	s.WaitOp(sn.Operation.ID, api.OpSucceeded)
	for _, tc := range []struct {
		method, path, body string
		code               int
		contains           string
	}{
		{"POST", "/v1/sandboxes/" + sb.ID + "/snapshots", `{"name":"http"}`, 409, "exists"},
		{"POST", "/v1/sandboxes/" + sb.ID + "/snapshots", `{"nme":"x"}`, 400, "unknown field"},
		{"POST", "/v1/sandboxes/" + sb.ID + "/snapshots", `{"name":"-x"}`, 400, "invalid"},
		{"POST", "/v1/sandboxes/nosuch/snapshots", ``, 404, "not found"},
		{"GET", "/v1/snapshots/http", ``, 200, sn.ID},
		{"GET", "/v1/snapshots/nosuch", ``, 404, "not found"},
		{"GET", "/v1/snapshots?limit=0", ``, 400, "limit"},
		{"GET", "/v1/snapshots?sandbox=" + sb.ID, ``, 200, sn.ID},
		{"GET", "/v1/sandboxes/" + sb.ID + "/metrics?start=yesterday", ``, 400, "unix seconds"},
		{"GET", "/v1/sandboxes/" + sb.ID + "/metrics?start=2030-01-01T00:00:00Z&end=2029-01-01T00:00:00Z", ``, 400, "before"},
		{"GET", "/v1/sandboxes/" + sb.ID + "/metrics", ``, 200, `"cpu_count":1`},
		{"GET", "/v1/sandboxes/nosuch/metrics", ``, 404, "not found"},
		{"POST", "/v1/sandboxes", `{"snapshot":"http","memory_mb":64}`, 400, "resources"},
	} {
		if code, body := do(t, s, tc.method, tc.path, tc.body); code != tc.code || !strings.Contains(body, tc.contains) {
			t.Errorf("%s %s %s: %d %s, want %d with %q", tc.method, tc.path, tc.body, code, body, tc.code, tc.contains)
		}
	}
	// Idempotent create from a snapshot.
	code, first := do(t, s, "POST", "/v1/sandboxes", `{"snapshot":"http"}`, "Idempotency-Key", "from-snap")
	code2, second := do(t, s, "POST", "/v1/sandboxes", `{"snapshot":"http"}`, "Idempotency-Key", "from-snap")
	if code != 202 || code2 != 202 || first != second {
		t.Fatalf("idempotent create from snapshot: %d %s / %d %s", code, first, code2, second)
	}
	// At the disk reserve: no capture, no sandbox from a snapshot.
	s.Disk.SetFull("the store is at its reserve (test)")
	s.Eventually(10*time.Second, "snapshots to be refused", func() bool {
		code, body := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/snapshots", `{}`)
		return code == 507 && strings.Contains(body, "reserve")
	})
	if code, body := do(t, s, "POST", "/v1/sandboxes", `{"snapshot":"http"}`); code != 507 {
		t.Fatalf("create from snapshot on a full node: %d %s", code, body)
	}
	s.Disk.SetFull("")
	s.Eventually(10*time.Second, "the node to have room", func() bool {
		code, _ := do(t, s, "POST", "/v1/sandboxes/"+sb.ID+"/snapshots", `{}`)
		return code == 202
	})
	if code, body := do(t, s, "DELETE", "/v1/snapshots/http", ``); code != 409 && code != 202 {
		t.Fatalf("delete: %d %s", code, body)
	}
}
