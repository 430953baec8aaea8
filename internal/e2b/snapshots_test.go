package e2b_test

import (
	"net/http"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strconv"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
)

// fork is a space clone: memory and disk, one result per fork, each with its own
// timeout and the source's metadata; the source keeps running.
func TestFork(t *testing.T) {
	g := startGateway(t, spacetest.Options{})
	src := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300, "metadata": map[string]string{"k": "v"},
		"autoPause": true})
	root, _ := g.s.Disk.SandboxRoot(src.SandboxID)
	if err := os.WriteFile(filepath.Join(root, "marker"), []byte("from the source"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := g.do("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"count": 2, "timeout": 120})
	want(t, "fork", r, http.StatusCreated)
	var results []struct {
		Sandbox *created `json:"sandbox"`
		Error   *struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	r.json(t, &results)
	if len(results) != 2 {
		t.Fatalf("fork results: %s", r)
	}
	for _, res := range results {
		if res.Error != nil || res.Sandbox == nil || res.Sandbox.SandboxID == src.SandboxID || res.Sandbox.EnvdAccessToken == "" {
			t.Fatalf("fork result: %s", r)
		}
		row := g.row(res.Sandbox.SandboxID)
		if row.CloneOf != src.SandboxID || row.State != api.StateRunning || row.Metadata["k"] != "v" || row.ExpireAction != "suspend" ||
			row.ExpiresAt == nil || time.Until(*row.ExpiresAt) > 121*time.Second || time.Until(*row.ExpiresAt) < 100*time.Second {
			t.Fatalf("fork row: %+v", row)
		}
		froot, _ := g.s.Disk.SandboxRoot(row.ID)
		if b, err := os.ReadFile(filepath.Join(froot, "marker")); err != nil || string(b) != "from the source" {
			t.Fatalf("fork's disk: %q %v", b, err)
		}
	}
	if d := g.get(src.SandboxID); d.State != "running" {
		t.Fatalf("source after the fork: %+v", d)
	}
	// The legacy default timeout (15 s) and the v2 path.
	r = g.do("POST", "/v2/sandboxes/"+src.SandboxID+"/fork", nil)
	want(t, "fork v2", r, http.StatusCreated)
	r.json(t, &results)
	if len(results) != 1 || results[0].Sandbox == nil {
		t.Fatalf("fork v2: %s", r)
	}
	if row := g.row(results[0].Sandbox.SandboxID); row.ExpiresAt == nil || time.Until(*row.ExpiresAt) > 16*time.Second {
		t.Fatalf("default fork timeout: %+v", row.ExpiresAt)
	}
	want(t, "too many forks", g.do("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"count": 51}), http.StatusBadRequest)
	want(t, "fork with a bad timeout", g.do("POST", "/sandboxes/"+src.SandboxID+"/fork", map[string]any{"timeout": -1}), http.StatusBadRequest)
	// A sandbox paused without memory has nothing to fork.
	want(t, "pause without memory", g.do("POST", "/sandboxes/"+src.SandboxID+"/pause", map[string]any{"memory": false}), http.StatusNoContent)
	want(t, "fork of a stopped sandbox", g.do("POST", "/sandboxes/"+src.SandboxID+"/fork", nil), http.StatusConflict, "no memory")
}

type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// createSnapshot, listSnapshots, deleteSnapshot, and Sandbox.create with a snapshot id.
func TestSnapshots(t *testing.T) {
	g := startGateway(t, spacetest.Options{})
	src := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300})
	root, _ := g.s.Disk.SandboxRoot(src.SandboxID)
	if err := os.WriteFile(filepath.Join(root, "marker"), []byte("snapshotted"), 0o644); err != nil {
		t.Fatal(err)
	}
	r := g.do("POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "my-snap"})
	want(t, "create snapshot", r, http.StatusCreated)
	var named snapshotInfo
	r.json(t, &named)
	if named.SnapshotID != "my-snap" || len(named.Names) != 1 || named.Names[0] != "my-snap" {
		t.Fatalf("snapshot info: %s", r)
	}
	r = g.do("POST", "/sandboxes/"+src.SandboxID+"/snapshots", "{}")
	want(t, "unnamed snapshot", r, http.StatusCreated)
	var unnamed snapshotInfo
	r.json(t, &unnamed)
	// A name that exists moves to the new snapshot (E2B: a new build of the template).
	r = g.do("POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "team/my-snap:default"})
	want(t, "snapshot with a taken name", r, http.StatusCreated)
	snaps, err := g.s.Service.Snapshots(g.s.Context(), &service.Principal{Tenant: "default"}, service.SnapshotFilter{})
	if err != nil || len(snaps) != 3 || snaps[0].Name != "my-snap" || snaps[2].Name != snaps[2].ID {
		t.Fatalf("snapshots: %+v %v", snaps, err)
	}
	want(t, "snapshot of nothing", g.do("POST", "/sandboxes/nosuch/snapshots", "{}"), http.StatusNotFound)
	want(t, "bad name", g.do("POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": "no spaces"}), http.StatusBadRequest)

	// Listing, by source and name, paginated.
	var list []snapshotInfo
	r = g.do("GET", "/snapshots", nil)
	want(t, "list", r, http.StatusOK)
	r.json(t, &list)
	if len(list) != 3 || list[0].SnapshotID != "my-snap" {
		t.Fatalf("list: %s", r)
	}
	r = g.do("GET", "/snapshots?name=my-snap:default&sandboxID="+src.SandboxID, nil)
	r.json(t, &list)
	if len(list) != 1 || list[0].SnapshotID != "my-snap" {
		t.Fatalf("list by name: %s", r)
	}
	r = g.do("GET", "/snapshots?limit=2", nil)
	r.json(t, &list)
	next := r.hdr.Get("X-Next-Token")
	if len(list) != 2 || next == "" {
		t.Fatalf("first page: %s %v", r, r.hdr)
	}
	r = g.do("GET", "/snapshots?limit=2&nextToken="+next, nil)
	r.json(t, &list)
	if len(list) != 1 || r.hdr.Get("X-Next-Token") != "" {
		t.Fatalf("second page: %s", r)
	}
	r = g.do("GET", "/snapshots?sandboxID=other", nil)
	if r.json(t, &list); len(list) != 0 {
		t.Fatalf("list of another sandbox: %s", r)
	}

	// A snapshot id is a template id: the new sandbox restores from it.
	for _, tmpl := range []string{"my-snap", "team/my-snap:default", unnamed.SnapshotID} {
		c := g.create("/v2/sandboxes", map[string]any{"templateID": tmpl, "timeout": 60, "envVars": map[string]string{"A": "1"}})
		row := g.row(c.SandboxID)
		if row.Spec.Snapshot == "" || row.StartPath != "snapshot" || row.Spec.Env["A"] != "1" || row.State != api.StateRunning {
			t.Fatalf("sandbox from %s: %+v", tmpl, row)
		}
		croot, _ := g.s.Disk.SandboxRoot(c.SandboxID)
		if b, err := os.ReadFile(filepath.Join(croot, "marker")); err != nil || string(b) != "snapshotted" {
			t.Fatalf("disk of the sandbox from %s: %q %v", tmpl, b, err)
		}
	}
	want(t, "an unknown template is still unknown", g.do("POST", "/v2/sandboxes", map[string]any{"templateID": "my-snap:v2"}), http.StatusNotFound)

	// deleteSnapshot is DELETE /templates/{id}: 204, then 404 (the SDK's false).
	want(t, "delete snapshot", g.do("DELETE", "/templates/my-snap", nil), http.StatusNoContent)
	want(t, "delete again", g.do("DELETE", "/templates/my-snap", nil), http.StatusNotFound)
	want(t, "delete a template", g.do("DELETE", "/templates/base", nil), http.StatusNotFound, "space template rm")
	g.s.Eventually(30*time.Second, "the deleted snapshot to go", func() bool {
		snaps, _ := g.s.Service.Snapshots(g.s.Context(), &service.Principal{Tenant: "default"}, service.SnapshotFilter{})
		return len(snaps) == 2
	})
	// Another tenant sees none of them.
	other := g.s.NewKey("other", false, service.KeyE2B)
	r = g.do("GET", "/snapshots", nil, "X-API-KEY", other)
	if r.json(t, &list); len(list) != 0 {
		t.Fatalf("another tenant's list: %s", r)
	}
	want(t, "another tenant's snapshot", g.do("DELETE", "/templates/"+unnamed.SnapshotID, nil, "X-API-KEY", other), http.StatusNotFound)
}

// pause({keepMemory: false}) and autoPauseMemory: false are space's stop: the disk is
// kept, the memory dropped, and a resume boots.
func TestPauseWithoutMemory(t *testing.T) {
	g := startGateway(t, spacetest.Options{})
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300})
	want(t, "pause without memory", g.do("POST", "/sandboxes/"+a.SandboxID+"/pause", `{"memory":false}`), http.StatusNoContent)
	if row := g.row(a.SandboxID); row.State != api.StateStopped || row.ExpiresAt != nil {
		t.Fatalf("row after pause without memory: %+v", row)
	}
	if d := g.get(a.SandboxID); d.State != "paused" {
		t.Fatalf("get: %+v", d)
	}
	want(t, "pause again", g.do("POST", "/sandboxes/"+a.SandboxID+"/pause", `{"memory":false}`), http.StatusConflict)
	want(t, "connect boots it", g.do("POST", "/v2/sandboxes/"+a.SandboxID+"/connect", `{"timeout":60}`), http.StatusCreated)
	if row := g.row(a.SandboxID); row.State != api.StateRunning {
		t.Fatalf("row after connect: %+v", row)
	}
	want(t, "pause with memory", g.do("POST", "/sandboxes/"+a.SandboxID+"/pause", `{"memory":true}`), http.StatusNoContent)
	if row := g.row(a.SandboxID); row.State != api.StateSuspended {
		t.Fatalf("row after pause with memory: %+v", row)
	}

	// At the timeout: stopped, shown as paused with onTimeout pause.
	want(t, "autoResume needs memory", g.do("POST", "/v2/sandboxes", map[string]any{"templateID": "base", "autoPause": true,
		"autoPauseMemory": false, "autoResume": map[string]any{"enabled": true}}), http.StatusBadRequest, "autoPauseMemory")
	b := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 1, "autoPause": true, "autoPauseMemory": false})
	if d := g.get(b.SandboxID); d.Lifecycle.OnTimeout != "pause" || d.Lifecycle.AutoResume {
		t.Fatalf("lifecycle: %+v", d.Lifecycle)
	}
	g.s.Eventually(30*time.Second, "the timeout to stop it", func() bool {
		row := g.row(b.SandboxID)
		return row.State == api.StateStopped && row.DesiredState == api.StateStopped
	})
	if d := g.get(b.SandboxID); d.State != "paused" {
		t.Fatalf("get after the timeout: %+v", d)
	}
	// Traffic does not resume it (E2B refuses auto-resume without memory).
	want(t, "envd of a sandbox paused without memory", g.envd("GET", b.SandboxID, "/health", nil, "X-Access-Token", g.get(b.SandboxID).EnvdAccessToken), http.StatusBadGateway)
}

// getMetrics says what the sandbox's limits are, from the history its node keeps.
func TestMetricsAreTheSandboxs(t *testing.T) {
	// A vCPU count the node can run (no more than the host's CPUs, which the node
	// reports) that differs from the host's where it can: the samples are the sandbox's.
	cpus := max(1, goruntime.NumCPU()-1)
	g := startGateway(t, spacetest.Options{Service: func(c *service.Config) { c.DefaultCPU = cpus; c.DefaultMemoryMB = 384; c.DefaultDiskMB = 2048 }})
	a := g.create("/v2/sandboxes", map[string]any{"templateID": "base", "timeout": 300})
	var samples []struct {
		CPUCount   int     `json:"cpuCount"`
		CPUUsedPct float64 `json:"cpuUsedPct"`
		MemUsed    int64   `json:"memUsed"`
		MemTotal   int64   `json:"memTotal"`
		DiskTotal  int64   `json:"diskTotal"`
		TS         int64   `json:"timestampUnix"`
	}
	// Right after create: one sample taken now; then the history grows.
	r := g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics", nil)
	want(t, "metrics", r, http.StatusOK)
	r.json(t, &samples)
	if len(samples) != 1 {
		t.Fatalf("metrics right after create: %s", r)
	}
	g.s.Eventually(30*time.Second, "two stored samples", func() bool {
		r = g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics", nil)
		r.json(t, &samples)
		return len(samples) >= 2
	})
	for _, m := range samples {
		if m.CPUCount != cpus || m.MemTotal != 384<<20 || m.DiskTotal != 2048<<20 || m.CPUUsedPct < 0 || m.CPUUsedPct > 100 ||
			m.MemUsed <= 0 || m.MemUsed > m.MemTotal || m.TS <= 0 {
			t.Fatalf("sample: %+v", m)
		}
	}
	first := strconv.FormatInt(samples[0].TS, 10)
	r = g.do("GET", "/sandboxes/"+a.SandboxID+"/metrics?start="+first+"&end="+first, nil)
	if r.json(t, &samples); len(samples) != 1 {
		t.Fatalf("metrics of one second: %s", r)
	}
}
