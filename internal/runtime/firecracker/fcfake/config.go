package fcfake

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Config configures the fake binaries (cmd/firecracker and cmd/jailer), which take only
// the real programs' command lines. It is read from the file named by $FCFAKE_CONFIG, else
// from the executable's own path plus ".json" (so a test places a config next to the
// binary it points the runtime at), else defaults apply.
type Config struct {
	// Version is the emulated release of both programs (default DefaultVersion).
	Version string `json:"version,omitempty"`
	// AgentSocket is a unix socket the guest's vsock listener is bridged to.
	AgentSocket string `json:"agent_socket,omitempty"`
	// Record is a file to which every API call is appended as a JSON line.
	Record string `json:"record,omitempty"`
	// BootDelay is how long after InstanceStart the guest agent listens (Go duration).
	BootDelay string `json:"boot_delay,omitempty"`
	// CgroupRoot stands in for the cgroup v2 mount the jailer creates cgroups in.
	CgroupRoot string `json:"cgroup_root,omitempty"`
	// JailerRecord is a file to which every jailer invocation is appended as a JSON line.
	JailerRecord string `json:"jailer_record,omitempty"`
}

// Environment the fake jailer passes to the fake firecracker (the real jailer clears the
// environment; these only exist between the two fakes).
const (
	EnvConfig = "FCFAKE_CONFIG"
	EnvRoot   = "FCFAKE_ROOT" // the emulated chroot
	EnvUID    = "FCFAKE_UID"
	EnvGID    = "FCFAKE_GID"
)

// LoadConfig reads the binary's configuration (see Config).
func LoadConfig() (Config, string, error) {
	p := os.Getenv(EnvConfig)
	if p == "" {
		exe, err := os.Executable()
		if err != nil {
			return Config{}, "", err
		}
		p = exe + ".json"
		if _, err := os.Stat(p); err != nil {
			return Config{Version: DefaultVersion}, "", nil
		}
	}
	var c Config
	data, err := os.ReadFile(p)
	if err != nil {
		return c, p, err
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return c, p, fmt.Errorf("%s: %w", p, err)
	}
	if c.Version == "" {
		c.Version = DefaultVersion
	}
	if c.BootDelay != "" {
		if _, err := time.ParseDuration(c.BootDelay); err != nil {
			return c, p, fmt.Errorf("%s: boot_delay: %w", p, err)
		}
	}
	return c, p, nil
}

// WriteConfig writes c next to the fake binary exe, where LoadConfig finds it.
func WriteConfig(exe string, c Config) error {
	data, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(exe+".json", data, 0o644)
}

// AppendJSONLine appends v as one JSON line to the file p (records of the fake binaries):
// one O_APPEND write, so lines from concurrent writers never interleave.
func AppendJSONLine(p string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(data, '\n')); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// ReadCalls reads the calls a fake firecracker recorded in p.
func ReadCalls(p string) ([]Call, error) {
	data, err := os.ReadFile(filepath.Clean(p))
	if err != nil {
		return nil, err
	}
	var calls []Call
	dec := json.NewDecoder(bytes.NewReader(data))
	for dec.More() {
		var c Call
		if err := dec.Decode(&c); err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		calls = append(calls, c)
	}
	return calls, nil
}
