package fcfake

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
)

// Request bodies, field for field as in Firecracker's API (swagger definitions of the
// same names). Pointers tell "absent" from "zero". A `since` tag gives the version that
// introduced a field: to an older emulated Firecracker it is an unknown field.

type bootSource struct {
	KernelImagePath *string `json:"kernel_image_path"`
	BootArgs        *string `json:"boot_args,omitempty"`
	InitrdPath      *string `json:"initrd_path,omitempty"`
}

type tokenBucket struct {
	Size         *int64 `json:"size"`
	OneTimeBurst *int64 `json:"one_time_burst,omitempty"`
	RefillTime   *int64 `json:"refill_time"`
}

type rateLimiter struct {
	Bandwidth *tokenBucket `json:"bandwidth,omitempty"`
	Ops       *tokenBucket `json:"ops,omitempty"`
}

type drive struct {
	DriveID      *string      `json:"drive_id"`
	PartUUID     *string      `json:"partuuid,omitempty"`
	IsRootDevice *bool        `json:"is_root_device"`
	CacheType    *string      `json:"cache_type,omitempty"`
	IsReadOnly   *bool        `json:"is_read_only,omitempty"`
	PathOnHost   *string      `json:"path_on_host,omitempty"`
	RateLimiter  *rateLimiter `json:"rate_limiter,omitempty"`
	IOEngine     *string      `json:"io_engine,omitempty"`
	Socket       *string      `json:"socket,omitempty" since:"1.6"`
}

type partialDrive struct {
	DriveID     *string      `json:"drive_id"`
	PathOnHost  *string      `json:"path_on_host,omitempty"`
	RateLimiter *rateLimiter `json:"rate_limiter,omitempty"`
}

type networkInterface struct {
	IfaceID       *string      `json:"iface_id"`
	HostDevName   *string      `json:"host_dev_name"`
	GuestMAC      *string      `json:"guest_mac,omitempty"`
	RxRateLimiter *rateLimiter `json:"rx_rate_limiter,omitempty"`
	TxRateLimiter *rateLimiter `json:"tx_rate_limiter,omitempty"`
}

type machineConfig struct {
	VcpuCount       *int    `json:"vcpu_count"`
	MemSizeMib      *int    `json:"mem_size_mib"`
	Smt             *bool   `json:"smt,omitempty"`
	TrackDirtyPages *bool   `json:"track_dirty_pages,omitempty"`
	HugePages       *string `json:"huge_pages,omitempty" since:"1.7"`
	CPUTemplate     *string `json:"cpu_template,omitempty"`
}

type vsockDevice struct {
	GuestCID *int64  `json:"guest_cid"`
	UDSPath  *string `json:"uds_path"`
	VsockID  *string `json:"vsock_id,omitempty"`
}

type entropy struct {
	RateLimiter *rateLimiter `json:"rate_limiter,omitempty"`
}

type logger struct {
	LogPath       *string `json:"log_path,omitempty"`
	Level         *string `json:"level,omitempty"`
	ShowLevel     *bool   `json:"show_level,omitempty"`
	ShowLogOrigin *bool   `json:"show_log_origin,omitempty"`
	Module        *string `json:"module,omitempty"`
}

type metrics struct {
	MetricsPath *string `json:"metrics_path"`
}

type action struct {
	ActionType *string `json:"action_type"`
}

type vmState struct {
	State *string `json:"state"`
}

type snapshotCreate struct {
	MemFilePath  *string `json:"mem_file_path"`
	SnapshotPath *string `json:"snapshot_path"`
	SnapshotType *string `json:"snapshot_type,omitempty"`
}

type memoryBackend struct {
	BackendType *string `json:"backend_type"`
	BackendPath *string `json:"backend_path"`
}

type networkOverride struct {
	IfaceID     *string `json:"iface_id"`
	HostDevName *string `json:"host_dev_name"`
}

type vsockOverride struct {
	UDSPath *string `json:"uds_path"`
}

type snapshotLoad struct {
	EnableDiffSnapshots *bool              `json:"enable_diff_snapshots,omitempty"`
	TrackDirtyPages     *bool              `json:"track_dirty_pages,omitempty" since:"1.13"`
	MemFilePath         *string            `json:"mem_file_path,omitempty"`
	MemBackend          *memoryBackend     `json:"mem_backend,omitempty" since:"1.1"`
	SnapshotPath        *string            `json:"snapshot_path"`
	ResumeVM            *bool              `json:"resume_vm,omitempty"`
	NetworkOverrides    *[]networkOverride `json:"network_overrides,omitempty" since:"1.12"`
	VsockOverride       *vsockOverride     `json:"vsock_override,omitempty" since:"1.16"`
	ClockRealtime       *bool              `json:"clock_realtime,omitempty" since:"1.16"`
}

// deserializeMsg words a body error as Firecracker (serde) does.
func deserializeMsg(msg string) string {
	return "An error occurred when deserializing the json body of a request: " + msg + "."
}

// decode parses body into v (a pointer to one of the request types) as strictly as
// Firecracker: exact, known, non-repeated keys at every level, then types.
func (s *Server) decode(body []byte, v any) error {
	if len(bytes.TrimSpace(body)) == 0 {
		return errors.New(deserializeMsg("EOF while parsing a value at line 1 column 0"))
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := s.checkObject(dec, reflect.TypeOf(v).Elem()); err != nil {
		return errors.New(deserializeMsg(err.Error()))
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New(deserializeMsg("trailing characters"))
	}
	if err := json.Unmarshal(body, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return errors.New(deserializeMsg(fmt.Sprintf("invalid type: %s, expected %s for field `%s`", te.Value, te.Type, te.Field)))
		}
		return errors.New(deserializeMsg(err.Error()))
	}
	return nil
}

// checkObject reads one JSON value from dec that must be an object of type t (or
// null), checking its keys against t's json tags, recursively.
func (s *Server) checkObject(dec *json.Decoder, t reflect.Type) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if tok == nil {
		return nil
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return fmt.Errorf("invalid type: %v, expected struct %s", tok, t.Name())
	}
	fields := s.fields(t)
	seen := map[string]bool{}
	for dec.More() {
		kt, err := dec.Token()
		if err != nil {
			return err
		}
		key, _ := kt.(string)
		f, ok := fields[key]
		if !ok {
			names := make([]string, 0, len(fields))
			for i := range t.NumField() {
				if n := jsonName(t.Field(i)); n != "" && fields[n].Name != "" {
					names = append(names, "`"+n+"`")
				}
			}
			return fmt.Errorf("unknown field `%s`, expected one of %s", key, strings.Join(names, ", "))
		}
		if seen[key] {
			return fmt.Errorf("duplicate field `%s`", key)
		}
		seen[key] = true
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch {
		case ft.Kind() == reflect.Struct:
			if err := s.checkObject(dec, ft); err != nil {
				return err
			}
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			tok, err := dec.Token()
			if err != nil {
				return err
			}
			if tok == nil {
				continue
			}
			if d, ok := tok.(json.Delim); !ok || d != '[' {
				return fmt.Errorf("invalid type: %v, expected a sequence for field `%s`", tok, key)
			}
			for dec.More() {
				if err := s.checkObject(dec, ft.Elem()); err != nil {
					return err
				}
			}
			if _, err := dec.Token(); err != nil {
				return err
			}
		default:
			var raw json.RawMessage
			if err := dec.Decode(&raw); err != nil {
				return err
			}
		}
	}
	_, err = dec.Token() // '}'
	return err
}

// fields maps the json names of t's fields that exist in the emulated version.
func (s *Server) fields(t reflect.Type) map[string]reflect.StructField {
	out := map[string]reflect.StructField{}
	for i := range t.NumField() {
		f := t.Field(i)
		name := jsonName(f)
		if name == "" {
			continue
		}
		if since := f.Tag.Get("since"); since != "" {
			v, err := parseVersion(since)
			if err == nil && !s.version.atLeast(v.major, v.minor) {
				continue
			}
		}
		out[name] = f
	}
	return out
}

func jsonName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	if name == "-" {
		return ""
	}
	return name
}

// version is a Firecracker release number.
type version struct{ major, minor, patch int }

// parseVersion parses "1.16.1", "v1.16.1", "1.17.0-dev" or "1.16".
func parseVersion(s string) (version, error) {
	orig := s
	s = strings.TrimPrefix(strings.TrimSpace(s), "v")
	s, _, _ = strings.Cut(s, "-")
	parts := strings.Split(s, ".")
	if len(parts) < 2 || len(parts) > 3 {
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

func (v version) String() string { return fmt.Sprintf("%d.%d.%d", v.major, v.minor, v.patch) }
