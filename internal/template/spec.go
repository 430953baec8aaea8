package template

import (
	"encoding/json"
	"fmt"
	"path"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"sigs.k8s.io/yaml"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// Spec is a template build specification (docs/templates.md). It is written in YAML or
// JSON and parsed strictly by ParseSpec: unknown fields are errors.
type Spec struct {
	// Name and Tag name the release the build makes: name:tag (tag defaults to latest).
	Name string `json:"name"`
	Tag  string `json:"tag,omitempty"`
	// From is where the root filesystem comes from.
	From Source `json:"from"`
	// Steps run in order inside a build sandbox on the root filesystem.
	Steps []Step `json:"steps,omitempty"`
	// Config is the runtime configuration recorded with the release; it overrides the
	// defaults the source brings (an OCI image's config, a parent template's config).
	Config Config `json:"config,omitempty"`
}

// Source is where a template's root filesystem comes from. Exactly one field is set.
type Source struct {
	// Debian is a debootstrap of a Debian suite on the node.
	Debian *DebianSource `json:"debian,omitempty"`
	// Image is a registry reference with an explicit registry host and a tag or digest,
	// like registry.example.com/team/app:1.2.
	Image string `json:"image,omitempty"`
	// Archive is a path on the node: a docker-archive tarball (docker save) or an OCI
	// image layout directory.
	Archive string `json:"archive,omitempty"`
	// Dir is a directory on the node whose tree becomes the root filesystem.
	Dir string `json:"dir,omitempty"`
	// Template is an existing release, name:tag or name@sha256:…, whose root
	// filesystem is snapshotted.
	Template string `json:"template,omitempty"`
}

// DebianSource is a Debian suite built with debootstrap (variant minbase).
type DebianSource struct {
	Suite    string   `json:"suite"`
	Packages []string `json:"packages,omitempty"`
}

// Step is one build step: a command run in the build sandbox, or files copied into it.
type Step struct {
	// Run is a shell command line (run with /bin/sh -c) or an argv list (exec form).
	Run *Command `json:"run,omitempty"`
	// User runs the command (a name from the template's /etc/passwd or a uid;
	// default root).
	User string `json:"user,omitempty"`
	// Workdir is the command's working directory (default: the user's home, or /).
	Workdir string `json:"workdir,omitempty"`
	// Env is added to the template's environment for this command.
	Env map[string]string `json:"env,omitempty"`
	// Timeout bounds the command (default DefaultStepTimeout).
	Timeout Duration `json:"timeout,omitempty"`
	// Copy copies files from the node into the template.
	Copy *CopyStep `json:"copy,omitempty"`
}

// CopyStep copies a file or a directory tree from the node into the template, through
// the build sandbox's agent.
type CopyStep struct {
	// Src is an absolute path on the node, under a directory the node allows.
	Src string `json:"src"`
	// Dst is an absolute path in the template. A file copied to a path ending in "/"
	// keeps its name; a directory's contents are copied into Dst.
	Dst string `json:"dst"`
	// Mode is the permission bits of copied files (default: the source's).
	Mode *FileMode `json:"mode,omitempty"`
	// User owns what is copied (default root).
	User string `json:"user,omitempty"`
}

// Config is the runtime configuration recorded with a release. It is recorded with the
// release (storage.Release.Config, the database's release
// config) and is the one type of a release's configuration.
type Config struct {
	Env     map[string]string `json:"env,omitempty"`
	User    string            `json:"user,omitempty"`
	Workdir string            `json:"workdir,omitempty"`
	// Start is the argv of a command the sandbox starts at boot.
	Start []string `json:"start,omitempty"`
	// Default resources of sandboxes created from the template (0: the server's).
	CPU      int `json:"cpu,omitempty"`
	MemoryMB int `json:"memory_mb,omitempty"`
	DiskMB   int `json:"disk_mb,omitempty"`
	// Ready is a readiness check run in the sandbox after Start.
	Ready *Ready `json:"ready,omitempty"`
	// Warm is a command each warm-pool member runs once it is up (booted or restored)
	// and before it is parked, so that the files its owner's first command reads are in
	// the sandbox's page cache: a restored sandbox starts with an empty one, and the
	// first python3 costs two to four times a later one (docs/benchmarks.md).
	Warm *Command `json:"warm,omitempty"`
}

// Ready is a readiness check: the command succeeds (exit 0) once the sandbox is ready.
type Ready struct {
	Command Command `json:"command"`
	// Timeout bounds the wait for readiness (default 30s).
	Timeout Duration `json:"timeout,omitempty"`
}

// DefaultStepTimeout bounds a run step that sets no timeout.
const DefaultStepTimeout = time.Hour

// Command is a shell command line or an argv list. In JSON and YAML it is a string or
// a list of strings.
type Command struct {
	Shell string
	Argv  []string
}

// Args returns the argv to execute: the argv list, or /bin/sh -c with the line.
func (c Command) Args() []string {
	if c.Shell != "" {
		return []string{"/bin/sh", "-c", c.Shell}
	}
	return c.Argv
}

// Empty reports whether the command is unset.
func (c Command) Empty() bool { return c.Shell == "" && len(c.Argv) == 0 }

// String is a short display form.
func (c Command) String() string {
	if c.Shell != "" {
		return c.Shell
	}
	return strings.Join(c.Argv, " ")
}

// MarshalJSON writes the string or list form.
func (c Command) MarshalJSON() ([]byte, error) {
	if c.Shell != "" || c.Argv == nil {
		return json.Marshal(c.Shell)
	}
	return json.Marshal(c.Argv)
}

// UnmarshalJSON reads a string or a list of strings.
func (c *Command) UnmarshalJSON(b []byte) error {
	*c = Command{}
	if len(b) > 0 && b[0] == '"' {
		return json.Unmarshal(b, &c.Shell)
	}
	if len(b) > 0 && b[0] == '[' {
		return json.Unmarshal(b, &c.Argv)
	}
	return fmt.Errorf("a command must be a string or a list of strings, not %s", b)
}

// FileMode is a permission mode. In JSON and YAML it is an octal string ("0755") or a
// number (YAML's 0755 is octal already; in JSON write the string form).
type FileMode uint32

// MarshalJSON writes the octal string form.
func (m FileMode) MarshalJSON() ([]byte, error) {
	return json.Marshal(fmt.Sprintf("%04o", uint32(m)))
}

// UnmarshalJSON reads an octal string or a number.
func (m *FileMode) UnmarshalJSON(b []byte) error {
	var v uint64
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		v, err = strconv.ParseUint(strings.TrimPrefix(s, "0o"), 8, 32)
		if err != nil {
			return fmt.Errorf("mode %q is not an octal number", s)
		}
	} else if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("mode must be an octal string like \"0755\" or a number, not %s", b)
	}
	if v > 0o7777 {
		return fmt.Errorf("mode %o has bits beyond 07777", v)
	}
	*m = FileMode(v)
	return nil
}

// Duration is a time.Duration written as a Go duration string ("30s", "5m").
type Duration time.Duration

// MarshalJSON writes the string form.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON reads a duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("a duration must be a string like \"30s\", not %s", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil || v < 0 {
		return fmt.Errorf("invalid duration %q (write it like \"90s\" or \"5m\")", s)
	}
	*d = Duration(v)
	return nil
}

// Limits of a spec.
const (
	maxSteps    = 256
	maxEnv      = 128
	maxSpecText = 1 << 20
)

var (
	suiteRe   = regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}$`)
	packageRe = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]{1,127}$`)
	envKeyRe  = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,127}$`)
)

// ParseSpec parses a spec from YAML or JSON (JSON is YAML), strictly: unknown fields,
// duplicate keys and wrong types are errors. The spec is validated and its defaults
// filled in. Errors are fault.Invalid.
func ParseSpec(data []byte) (*Spec, error) {
	if len(data) > maxSpecText {
		return nil, fault.New(fault.Invalid, "spec is larger than %d bytes", maxSpecText)
	}
	var s Spec
	if err := yaml.UnmarshalStrict(data, &s); err != nil {
		return nil, fault.New(fault.Invalid, "spec: %s", cleanYAMLError(err))
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &s, nil
}

// cleanYAMLError drops the layers of context sigs.k8s.io/yaml puts around an error.
func cleanYAMLError(err error) string {
	msg := err.Error()
	for _, p := range []string{"error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		msg = strings.ReplaceAll(msg, p, "")
	}
	return msg
}

// Validate checks the spec and fills in defaults (tag latest). Errors are fault.Invalid.
func (s *Spec) Validate() error {
	if s.Tag == "" {
		s.Tag = "latest"
	}
	if strings.ContainsAny(s.Name, ":@") {
		return invalidf("name %q must not contain ':' or '@' (the tag goes in tag)", s.Name)
	}
	if _, err := api.ParseTemplateRef(s.Name + ":" + s.Tag); err != nil {
		return invalidf("%v", err)
	}
	if err := s.From.validate(); err != nil {
		return err
	}
	if len(s.Steps) > maxSteps {
		return invalidf("at most %d steps are allowed", maxSteps)
	}
	for i := range s.Steps {
		if err := s.Steps[i].validate(); err != nil {
			return invalidf("steps[%d]: %v", i, err)
		}
	}
	if err := s.Config.validate(); err != nil {
		return invalidf("config: %v", err)
	}
	return nil
}

// Ref returns name:tag.
func (s *Spec) Ref() string { return s.Name + ":" + s.Tag }

func invalidf(format string, args ...any) error { return fault.New(fault.Invalid, format, args...) }

func (f *Source) validate() error {
	n := 0
	for _, set := range []bool{f.Debian != nil, f.Image != "", f.Archive != "", f.Dir != "", f.Template != ""} {
		if set {
			n++
		}
	}
	if n != 1 {
		return invalidf("from must name exactly one source: debian, image, archive, dir or template")
	}
	switch {
	case f.Debian != nil:
		if !suiteRe.MatchString(f.Debian.Suite) {
			return invalidf("from.debian.suite %q is not a Debian suite name", f.Debian.Suite)
		}
		for _, p := range f.Debian.Packages {
			if !packageRe.MatchString(p) {
				return invalidf("from.debian.packages: %q is not a Debian package name", p)
			}
		}
	case f.Image != "":
		if _, err := parseImageRef(f.Image); err != nil {
			return invalidf("from.image: %v", err)
		}
	case f.Archive != "":
		if err := checkAbs(f.Archive); err != nil {
			return invalidf("from.archive: %v", err)
		}
	case f.Dir != "":
		if err := checkAbs(f.Dir); err != nil {
			return invalidf("from.dir: %v", err)
		}
	case f.Template != "":
		if _, err := api.ParseTemplateRef(f.Template); err != nil {
			return invalidf("from.template: %v", err)
		}
	}
	return nil
}

// parseImageRef parses an image reference that names its registry and its tag or
// digest explicitly (no defaulting to a public registry).
func parseImageRef(s string) (name.Reference, error) {
	ref, err := name.ParseReference(s, name.StrictValidation)
	if err != nil {
		return nil, fmt.Errorf("%q must be a full reference with registry host and tag or digest, like registry.example.com/repo:tag (%v)", s, err)
	}
	return ref, nil
}

func checkAbs(p string) error {
	if !path.IsAbs(p) {
		return fmt.Errorf("%q is not an absolute path", p)
	}
	if strings.ContainsRune(p, 0) {
		return fmt.Errorf("path contains NUL")
	}
	return nil
}

func (st *Step) validate() error {
	switch {
	case st.Run != nil && st.Copy != nil:
		return fmt.Errorf("a step has either run or copy, not both")
	case st.Run != nil:
		if st.Run.Empty() {
			return fmt.Errorf("run is empty")
		}
		for _, a := range st.Run.Argv {
			if strings.ContainsRune(a, 0) {
				return fmt.Errorf("run argument contains NUL")
			}
		}
		if len(st.Run.Argv) > 0 && st.Run.Argv[0] == "" {
			return fmt.Errorf("run: the program name is empty")
		}
		if st.Workdir != "" && !path.IsAbs(st.Workdir) {
			return fmt.Errorf("workdir %q is not an absolute path", st.Workdir)
		}
		return validateEnv(st.Env)
	case st.Copy != nil:
		if st.User != "" || st.Workdir != "" || st.Env != nil || st.Timeout != 0 {
			return fmt.Errorf("user, workdir, env and timeout belong to run steps (a copy has its own user)")
		}
		if err := checkAbs(st.Copy.Src); err != nil {
			return fmt.Errorf("copy.src: %v", err)
		}
		if err := checkAbs(st.Copy.Dst); err != nil {
			return fmt.Errorf("copy.dst: %v", err)
		}
		return nil
	default:
		return fmt.Errorf("a step needs run or copy")
	}
}

func validateEnv(env map[string]string) error {
	if len(env) > maxEnv {
		return fmt.Errorf("env has %d entries; at most %d are allowed", len(env), maxEnv)
	}
	for k, v := range env {
		if !envKeyRe.MatchString(k) {
			return fmt.Errorf("env name %q is invalid", k)
		}
		if strings.ContainsRune(v, 0) {
			return fmt.Errorf("env %s contains NUL", k)
		}
	}
	return nil
}

func (c *Config) validate() error {
	if err := validateEnv(c.Env); err != nil {
		return err
	}
	if c.Workdir != "" && !path.IsAbs(c.Workdir) {
		return fmt.Errorf("workdir %q is not an absolute path", c.Workdir)
	}
	if c.CPU < 0 || c.CPU > 64 {
		return fmt.Errorf("cpu must be between 0 (the server's default) and 64")
	}
	if c.MemoryMB != 0 && (c.MemoryMB < 64 || c.MemoryMB > 1<<20) {
		return fmt.Errorf("memory_mb must be 0 (the server's default) or between 64 and %d", 1<<20)
	}
	if c.DiskMB < 0 {
		return fmt.Errorf("disk_mb must not be negative")
	}
	for _, a := range c.Start {
		if strings.ContainsRune(a, 0) {
			return fmt.Errorf("start argument contains NUL")
		}
	}
	if len(c.Start) > 0 && c.Start[0] == "" {
		return fmt.Errorf("start: the program name is empty")
	}
	if c.Ready != nil && c.Ready.Command.Empty() {
		return fmt.Errorf("ready.command is empty")
	}
	if c.Warm != nil && c.Warm.Empty() {
		return fmt.Errorf("warm is empty")
	}
	return nil
}

// Merge returns base overridden by the fields set in over; environments are merged
// name by name.
func (base Config) Merge(over Config) Config {
	out := base
	out.Env = map[string]string{}
	for k, v := range base.Env {
		out.Env[k] = v
	}
	for k, v := range over.Env {
		out.Env[k] = v
	}
	if over.User != "" {
		out.User = over.User
	}
	if over.Workdir != "" {
		out.Workdir = over.Workdir
	}
	if len(over.Start) > 0 {
		out.Start = over.Start
	}
	if over.CPU != 0 {
		out.CPU = over.CPU
	}
	if over.MemoryMB != 0 {
		out.MemoryMB = over.MemoryMB
	}
	if over.DiskMB != 0 {
		out.DiskMB = over.DiskMB
	}
	if over.Ready != nil {
		r := *over.Ready
		out.Ready = &r
	}
	if over.Warm != nil {
		w := *over.Warm
		out.Warm = &w
	}
	return out
}

// ParseConfig decodes a release's recorded config (store.Release.Config). Empty input
// is the zero config.
func ParseConfig(data []byte) (Config, error) {
	var c Config
	if len(data) == 0 {
		return c, nil
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return Config{}, fmt.Errorf("template: decode release config: %w", err)
	}
	return c, nil
}
