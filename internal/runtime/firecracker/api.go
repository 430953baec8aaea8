package firecracker

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
)

// The thin client of Firecracker's REST API (HTTP/1.1 over the instance's API socket).
// Request types carry only the fields this runtime sets; optional ones are pointers or
// omitempty, so nothing an older Firecracker does not know is ever sent (its bodies are
// deny_unknown_fields: one unknown field fails the whole request).

type bootSource struct {
	KernelImagePath string `json:"kernel_image_path"`
	InitrdPath      string `json:"initrd_path,omitempty"`
	BootArgs        string `json:"boot_args,omitempty"`
}

type drive struct {
	DriveID      string  `json:"drive_id"`
	PathOnHost   string  `json:"path_on_host"`
	IsRootDevice bool    `json:"is_root_device"`
	IsReadOnly   *bool   `json:"is_read_only,omitempty"`
	CacheType    *string `json:"cache_type,omitempty"`
}

type machineConfig struct {
	VcpuCount  int   `json:"vcpu_count"`
	MemSizeMib int   `json:"mem_size_mib"`
	Smt        *bool `json:"smt,omitempty"`
}

type networkInterface struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
	GuestMAC    string `json:"guest_mac,omitempty"`
}

type vsockDevice struct {
	GuestCID uint32 `json:"guest_cid"`
	UDSPath  string `json:"uds_path"`
}

type instanceAction struct {
	ActionType string `json:"action_type"`
}

type vmState struct {
	State string `json:"state"`
}

type snapshotCreate struct {
	SnapshotType string `json:"snapshot_type,omitempty"`
	SnapshotPath string `json:"snapshot_path"`
	MemFilePath  string `json:"mem_file_path"`
}

type memBackend struct {
	BackendType string `json:"backend_type"`
	BackendPath string `json:"backend_path"`
}

type networkOverride struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
}

type vsockOverride struct {
	UDSPath string `json:"uds_path"`
}

type snapshotLoad struct {
	SnapshotPath     string            `json:"snapshot_path"`
	MemBackend       *memBackend       `json:"mem_backend,omitempty"`
	ResumeVM         *bool             `json:"resume_vm,omitempty"`
	NetworkOverrides []networkOverride `json:"network_overrides,omitempty"` // Firecracker ≥ 1.12
	VsockOverride    *vsockOverride    `json:"vsock_override,omitempty"`    // Firecracker ≥ 1.16
}

type instanceInfo struct {
	ID         string `json:"id"`
	State      string `json:"state"`
	VMMVersion string `json:"vmm_version"`
}

type versionInfo struct {
	FirecrackerVersion string `json:"firecracker_version"`
}

// Instance states of GET /.
const (
	stateNotStarted = "Not started"
	stateRunning    = "Running"
	statePaused     = "Paused"
)

func ptr[T any](v T) *T { return &v }

// APIError is a request Firecracker refused: its status and fault message.
type APIError struct {
	Method, Path string
	StatusCode   int
	FaultMessage string
}

func (e *APIError) Error() string {
	return fmt.Sprintf("firecracker %s %s: %d: %s", e.Method, e.Path, e.StatusCode, e.FaultMessage)
}

// apiClient talks to one Firecracker API socket.
type apiClient struct {
	hc *http.Client
}

func newAPIClient(socket string) *apiClient {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dialUnix(ctx, socket)
		},
		// Firecracker serves requests one at a time; a connection per request keeps an
		// idle connection from ever holding up another client of the same socket.
		DisableKeepAlives: true,
	}
	return &apiClient{hc: &http.Client{Transport: tr}}
}

// call sends one request (in marshalled as the body unless nil) and decodes a 200 answer
// into out (unless nil). Anything but 200/204 is an *APIError.
func (c *apiClient) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		data, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("firecracker %s %s: %w", method, path, err)
		}
		body = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://localhost"+path, body)
	if err != nil {
		return fmt.Errorf("firecracker %s %s: %w", method, path, err)
	}
	req.Header.Set("Accept", "application/json")
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("firecracker %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("firecracker %s %s: read answer: %w", method, path, err)
	}
	switch resp.StatusCode {
	case http.StatusNoContent:
		return nil
	case http.StatusOK:
		if out == nil {
			return nil
		}
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("firecracker %s %s: decode answer: %w", method, path, err)
		}
		return nil
	}
	var f struct {
		FaultMessage string `json:"fault_message"`
	}
	if json.Unmarshal(data, &f) != nil || f.FaultMessage == "" {
		f.FaultMessage = strings.TrimSpace(string(data))
	}
	return &APIError{Method: method, Path: path, StatusCode: resp.StatusCode, FaultMessage: f.FaultMessage}
}

func (c *apiClient) put(ctx context.Context, path string, in any) error {
	return c.call(ctx, http.MethodPut, path, in, nil)
}

func (c *apiClient) version(ctx context.Context) (version, error) {
	var v versionInfo
	if err := c.call(ctx, http.MethodGet, "/version", nil, &v); err != nil {
		return version{}, err
	}
	return parseVersion(v.FirecrackerVersion)
}

func (c *apiClient) instance(ctx context.Context) (instanceInfo, error) {
	var i instanceInfo
	err := c.call(ctx, http.MethodGet, "/", nil, &i)
	return i, err
}

func (c *apiClient) setVMState(ctx context.Context, state string) error {
	return c.call(ctx, http.MethodPatch, "/vm", vmState{State: state}, nil)
}

// version is a Firecracker release number.
type version struct{ major, minor, patch int }

// parseVersion parses "1.16.1", "v1.16.1" or "1.17.0-dev".
func parseVersion(s string) (version, error) {
	orig := s
	s = strings.TrimPrefix(strings.TrimSpace(s), "v")
	s, _, _ = strings.Cut(s, "-")
	parts := strings.Split(s, ".")
	if len(parts) != 3 {
		return version{}, fmt.Errorf("bad Firecracker version %q", orig)
	}
	var n [3]int
	for i, p := range parts {
		v, err := strconv.Atoi(p)
		if err != nil || v < 0 {
			return version{}, fmt.Errorf("bad Firecracker version %q", orig)
		}
		n[i] = v
	}
	return version{n[0], n[1], n[2]}, nil
}

func (v version) atLeast(major, minor int) bool {
	return v.major > major || v.major == major && v.minor >= minor
}

// sameLine reports whether snapshots of one version load in the other: Firecracker bumps
// its snapshot format's major version with nearly every minor release and loads only its
// own major, so in practice a snapshot loads only in the minor release that made it.
func (v version) sameLine(o version) bool { return v.major == o.major && v.minor == o.minor }

func (v version) String() string { return fmt.Sprintf("%d.%d.%d", v.major, v.minor, v.patch) }
