package api

import "time"

// OpSnapshot is the kind of the operation that takes a named snapshot of a sandbox.
const OpSnapshot = "snapshot"

// Snapshot states.
const (
	// SnapshotCreating: the source's memory and disk are being captured. A snapshot
	// whose capture fails is removed (its operation says why).
	SnapshotCreating = "creating"
	// SnapshotReady: sandboxes can be created from it.
	SnapshotReady = "ready"
	// SnapshotDeleting: removal was asked for; its node is removing its files.
	SnapshotDeleting = "deleting"
)

// Snapshot is a named snapshot: a sandbox's memory and disk captured at one moment and
// kept as a resource of its own, independent of the sandbox it was taken from (which
// may be deleted). New sandboxes restore from it.
type Snapshot struct {
	ID string `json:"id"`
	// Name is unique among the tenant's snapshots (the id when none was given).
	Name  string `json:"name"`
	State string `json:"state"`
	// SourceSandbox is the sandbox it was taken from.
	SourceSandbox string `json:"source_sandbox"`
	// Template and TemplateDigest are the source's template reference and release.
	Template       string `json:"template"`
	TemplateDigest string `json:"template_digest,omitempty"`
	// CPU, MemoryMB and DiskMB are the source's resources, which every sandbox
	// created from the snapshot has.
	CPU      int    `json:"cpu"`
	MemoryMB int    `json:"memory_mb"`
	DiskMB   int    `json:"disk_mb,omitempty"`
	Runtime  string `json:"runtime,omitempty"`
	// Node holds the snapshot's files; sandboxes created from it run there.
	Node string `json:"node,omitempty"`
	// SizeBytes is the disk space the snapshot holds: its memory image plus what
	// the source had written to its disk beyond its template.
	SizeBytes int64     `json:"size_bytes"`
	CreatedAt time.Time `json:"created_at"`
	// ReadyAt is when the capture finished.
	ReadyAt *time.Time `json:"ready_at,omitempty"`
	// Operation is the operation that takes the snapshot (set on create responses).
	Operation *Operation `json:"operation,omitempty"`
}

// CreateSnapshotRequest is the body of POST /v1/sandboxes/{id}/snapshots.
type CreateSnapshotRequest struct {
	// Name is unique among the tenant's snapshots; default: the snapshot's id.
	Name string `json:"name,omitempty"`
	// Replace, when the name is taken, moves the name to the new snapshot; the
	// snapshot that had it keeps existing under its id. Without it a taken name is a
	// conflict (409).
	Replace bool `json:"replace,omitempty"`
}

// SnapshotList is the body of GET /v1/snapshots.
type SnapshotList struct {
	Snapshots []Snapshot `json:"snapshots"`
}

// MetricSample is one sample of a sandbox's resource use. Totals are the sandbox's
// limits (its cpu, memory_mb and disk_mb), not the host's.
type MetricSample struct {
	Time time.Time `json:"time"`
	// Resolution is the span the sample stands for: "5s" for raw samples, "1m" and
	// "1h" for averages of older ones.
	Resolution string  `json:"resolution"`
	CPUCount   int     `json:"cpu_count"`
	CPUUsedPct float64 `json:"cpu_used_pct"`
	MemUsed    int64   `json:"mem_used_bytes"`
	MemTotal   int64   `json:"mem_total_bytes"`
	MemCache   int64   `json:"mem_cache_bytes"`
	DiskUsed   int64   `json:"disk_used_bytes"`
	DiskTotal  int64   `json:"disk_total_bytes"`
}

// MetricList is the body of GET /v1/sandboxes/{id}/metrics: samples oldest first.
type MetricList struct {
	SandboxID string         `json:"sandbox_id"`
	Samples   []MetricSample `json:"samples"`
}
