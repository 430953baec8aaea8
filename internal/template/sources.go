package template

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"

	"github.com/spacedev/space/internal/fault"
)

// SourcesSetting names the operator setting that allows template sources; refusals
// name it so the operator knows what to change.
const SourcesSetting = "space serve --template-sources"

// Sources is the operator's allowlist of template sources that read the node's files
// or fetch from registries: entries "registry:HOST[/PREFIX]" and "dir:/ABS/PATH". Debian
// suites and existing templates need no entry. The zero value allows neither images
// nor paths. Sources implements flag.Value (pflag.Value): each Set adds a
// comma-separated list.
type Sources struct {
	Registries []RegistryPrefix
	Dirs       []string
}

// RegistryPrefix allows the images of one registry host whose repository path starts
// with Prefix (whole path segments; empty allows the whole registry).
type RegistryPrefix struct {
	Host   string
	Prefix string
}

func (r RegistryPrefix) String() string {
	if r.Prefix == "" {
		return "registry:" + r.Host
	}
	return "registry:" + r.Host + "/" + r.Prefix
}

// ParseSources parses allowlist entries (each may itself be a comma-separated list).
func ParseSources(entries ...string) (Sources, error) {
	var s Sources
	for _, e := range entries {
		if err := s.Set(e); err != nil {
			return Sources{}, err
		}
	}
	return s, nil
}

// Set adds the entries of a comma-separated list.
func (s *Sources) Set(list string) error {
	for _, e := range strings.Split(list, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		kind, v, ok := strings.Cut(e, ":")
		switch {
		case ok && kind == "dir":
			if !filepath.IsAbs(v) {
				return fmt.Errorf("template source %q: the directory must be an absolute path", e)
			}
			s.Dirs = append(s.Dirs, filepath.Clean(v))
		case ok && kind == "registry":
			host, prefix, _ := strings.Cut(strings.Trim(v, "/"), "/")
			if host == "" || strings.ContainsAny(host, " @") {
				return fmt.Errorf("template source %q: want registry:HOST[/PREFIX]", e)
			}
			s.Registries = append(s.Registries, RegistryPrefix{Host: strings.ToLower(host), Prefix: strings.Trim(prefix, "/")})
		default:
			return fmt.Errorf("template source %q: want registry:HOST[/PREFIX] or dir:/ABS/PATH", e)
		}
	}
	return nil
}

// String returns the comma-separated list.
func (s *Sources) String() string { return strings.Join(s.Entries(), ",") }

// Type is the flag type name shown in help.
func (s *Sources) Type() string { return "list" }

// Entries returns the allowlist entries.
func (s Sources) Entries() []string {
	var out []string
	for _, r := range s.Registries {
		out = append(out, r.String())
	}
	for _, d := range s.Dirs {
		out = append(out, "dir:"+d)
	}
	return out
}

func (s Sources) describe() string {
	if e := s.Entries(); len(e) > 0 {
		return "allowed: " + strings.Join(e, ", ")
	}
	return "nothing is allowed"
}

// CheckPath checks that p, cleaned and with symbolic links resolved, lies under an
// allowed directory, and returns the resolved path. With mustExist false (a check made
// away from the node that reads the path) a path that does not resolve is checked as
// written. Refusals are fault.Forbidden.
func (s Sources) CheckPath(what, p string, mustExist bool) (string, error) {
	if !filepath.IsAbs(p) {
		return "", fault.New(fault.Invalid, "%s %q is not an absolute path", what, p)
	}
	clean := filepath.Clean(p)
	resolved, err := filepath.EvalSymlinks(clean)
	if err != nil {
		if mustExist || !errors.Is(err, fs.ErrNotExist) {
			if errors.Is(err, fs.ErrNotExist) {
				return "", fault.New(fault.Invalid, "%s %q does not exist on this node", what, p)
			}
			return "", fmt.Errorf("%s %q: %w", what, p, err)
		}
		resolved = clean
	}
	for _, d := range s.Dirs {
		if within(resolved, d) {
			return resolved, nil
		}
		if rd, err := filepath.EvalSymlinks(d); err == nil && within(resolved, rd) {
			return resolved, nil
		}
	}
	shown := resolved
	if shown != clean {
		shown = fmt.Sprintf("%s (resolves to %s)", clean, resolved)
	}
	return "", fault.New(fault.Forbidden, "%s %s is not under a directory allowed by %s (%s)", what, shown, SourcesSetting, s.describe())
}

// within reports whether p is dir or lies below it (both clean and absolute).
func within(p, dir string) bool {
	if dir == "/" {
		return true
	}
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// CheckImage checks that an image reference lies under an allowed registry prefix.
func (s Sources) CheckImage(ref string) error {
	r, err := parseImageRef(ref)
	if err != nil {
		return fault.New(fault.Invalid, "from.image: %v", err)
	}
	host := strings.ToLower(r.Context().RegistryStr())
	repo := r.Context().RepositoryStr()
	for _, a := range s.Registries {
		if a.Host != host {
			continue
		}
		if a.Prefix == "" || repo == a.Prefix || strings.HasPrefix(repo, a.Prefix+"/") {
			return nil
		}
	}
	return fault.New(fault.Forbidden, "image %s is not under a registry prefix allowed by %s (%s)", ref, SourcesSetting, s.describe())
}

// CheckSpec checks every source of the spec that reads the node's files or a registry
// (from.image, from.archive, from.dir, copy sources) against the allowlist. mustExist
// is false for the API's early check (see CheckPath) and true on the node.
func (s Sources) CheckSpec(spec *Spec, mustExist bool) error {
	switch {
	case spec.From.Image != "":
		if err := s.CheckImage(spec.From.Image); err != nil {
			return err
		}
	case spec.From.Archive != "":
		if _, err := s.CheckPath("from.archive", spec.From.Archive, mustExist); err != nil {
			return err
		}
	case spec.From.Dir != "":
		if _, err := s.CheckPath("from.dir", spec.From.Dir, mustExist); err != nil {
			return err
		}
	}
	for i, st := range spec.Steps {
		if st.Copy != nil {
			if _, err := s.CheckPath(fmt.Sprintf("steps[%d].copy.src", i), st.Copy.Src, mustExist); err != nil {
				return err
			}
		}
	}
	return nil
}
