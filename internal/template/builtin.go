package template

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spacedev/space/internal/guest/codeinterp"
	"github.com/spacedev/space/internal/storage"
)

// Builtin templates are built by space itself, from Debian packages, the first time a
// sandbox needs them (the node role) or a test does (templatetest): no spec, no
// registry, nothing but a Debian mirror.
//
//   - base: what an E2B user expects of E2B's base template. Debian bookworm (variant
//     minbase) with bash, coreutils, procps, iproute2, ca-certificates, curl, git,
//     sudo, python3 (also as python) with pip, Node.js with npm, build-essential; a
//     user "user" (uid 1000, home /home/user) who may sudo without a password.
//   - code-interpreter-v1: base (a snapshot of the base release, built first if this
//     store has none of the current recipe) plus Jupyter's Python kernel and the usual data
//     packages (numpy, pandas, matplotlib, scipy, seaborn, requests, bs4, openpyxl,
//     pillow), and space's code interpreter server (package codeinterp) started with
//     the sandbox on port 49999: what E2B's code interpreter SDKs talk to.
//
// Both are recipes: a package list and a fixed customization. BuiltinRecipeID names a
// recipe, so caches of built releases are refreshed when it changes.

// Names of the builtin templates.
const (
	BaseTemplate            = "base"
	CodeInterpreterTemplate = "code-interpreter-v1"
)

// builtinRecipeVersion is bumped whenever the customization below changes what it
// puts in the tree, its recorded config included (package lists are part of the recipe
// id by themselves). 5: the warm command. 6: a login shell starts no program
// (quickLogin).
const builtinRecipeVersion = "6"

var (
	// bootstrapPackages go in with debootstrap; the rest with apt-get in the new tree:
	// debootstrap's resolver does not follow virtual packages (Provides), which npm and
	// Jupyter's dependencies need.
	bootstrapPackages = []string{"bash", "coreutils", "procps", "iproute2", "ca-certificates", "python3"}
	basePackages      = []string{
		"curl", "git", "sudo", "python-is-python3", "python3-pip", "python3-venv",
		"nodejs", "npm", "build-essential",
	}
	codeInterpreterPackages = []string{
		"python3-ipykernel", "python3-jupyter-client",
		"python3-numpy", "python3-pandas", "python3-matplotlib", "python3-scipy", "python3-seaborn",
		"python3-requests", "python3-bs4", "python3-openpyxl", "python3-pil",
	}
)

// warmPython is the builtin templates' warm command: a pool member starts python3 once,
// so its owner's first python3 reads the interpreter from the page cache.
func warmPython() *Command { return &Command{Argv: []string{"/usr/bin/python3", "-c", "pass"}} }

// builtin is a builtin template's recipe.
type builtin struct {
	name string
	// parent is the builtin template this one starts from (a snapshot of its release);
	// empty starts from debootstrap.
	parent   string
	packages []string
	config   Config
	// extra customizes the tree after the common customization (chroot is the path of
	// chroot(8)).
	extra func(b *Builder, ctx context.Context, rootfs, chroot string) error
}

func builtinRecipe(name string) (builtin, bool) {
	switch name {
	case BaseTemplate:
		return builtin{name: name, packages: basePackages, config: Config{User: baseUser, Workdir: baseHome, Env: map[string]string{},
			Warm: warmPython()}}, true
	case CodeInterpreterTemplate:
		return builtin{
			name:     name,
			parent:   BaseTemplate,
			packages: codeInterpreterPackages,
			config: Config{
				User: baseUser, Workdir: baseHome, Env: map[string]string{},
				Warm:  warmPython(),
				Start: []string{"/usr/bin/python3", codeinterp.Path},
				Ready: &Ready{
					Command: Command{Argv: []string{"/usr/bin/curl", "-fsS", "-o", "/dev/null", fmt.Sprintf("http://127.0.0.1:%d/health", codeinterp.Port)}},
					Timeout: Duration(3 * time.Minute),
				},
			},
			extra: customizeCodeInterpreter,
		}, true
	}
	return builtin{}, false
}

// Builtins lists the builtin templates.
func Builtins() []string { return []string{BaseTemplate, CodeInterpreterTemplate} }

// BuiltinParent names the builtin template that builtin name starts from ("" for one
// that starts from debootstrap).
func BuiltinParent(name string) string {
	r, _ := builtinRecipe(name)
	return r.parent
}

// IsBuiltin reports whether name is a builtin template.
func IsBuiltin(name string) bool { return slices.Contains(Builtins(), name) }

// BuiltinRecipeID identifies what BuildBuiltin builds for name (suite, variant,
// packages, customization). Two builds with the same recipe differ only in package
// versions and timestamps.
func BuiltinRecipeID(name string) string {
	r, ok := builtinRecipe(name)
	if !ok {
		return ""
	}
	parts := []string{builtinRecipeVersion, r.name, baseSuite, baseVariant, strings.Join(bootstrapPackages, ","),
		strings.Join(r.packages, ","), baseUser, baseUID, baseHome}
	if r.parent != "" {
		parts = append(parts, "from", BuiltinRecipeID(r.parent))
	}
	if r.name == CodeInterpreterTemplate {
		sum := sha256.Sum256(codeinterp.Server)
		parts = append(parts, hex.EncodeToString(sum[:]))
	}
	sum := sha256.Sum256([]byte(strings.Join(parts, "\x00")))
	return hex.EncodeToString(sum[:6])
}

// BaseRecipeID is BuiltinRecipeID(BaseTemplate).
func BaseRecipeID() string { return BuiltinRecipeID(BaseTemplate) }

// BuildBuiltin builds the builtin template name and returns its release and config.
// If a release with the same content digest exists already, the new build is dropped
// and the existing release returned. progress, if not nil, receives debootstrap's
// status lines ("I: ...") and the build's own. Needs root.
func (b *Builder) BuildBuiltin(ctx context.Context, name string, progress func(string)) (storage.Release, Config, error) {
	r, ok := builtinRecipe(name)
	if !ok {
		return storage.Release{}, Config{}, fmt.Errorf("template: %q is not a builtin template", name)
	}
	if b.Store == nil {
		return storage.Release{}, Config{}, errors.New("template: Builder.Store is nil")
	}
	if progress == nil {
		progress = func(string) {}
	}
	build, err := b.Store.BeginRelease(ctx)
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	defer build.Discard(ctx)
	rootfs := build.Rootfs()

	log := b.logger()
	start := time.Now()
	log.InfoContext(ctx, "template: building builtin", "template", name, "suite", baseSuite, "dir", rootfs)
	var chroot string
	if r.parent != "" {
		parent, err := b.builtinParent(ctx, r.parent, progress)
		if err != nil {
			return storage.Release{}, Config{}, err
		}
		progress(fmt.Sprintf("I: starting from %s (%s)", r.parent, parent.Digest))
		parentRoot, err := b.Store.ReleaseRoot(parent.Digest)
		if err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
		}
		// Replace the build's empty subvolume with a writable snapshot of the parent.
		if err := b.Store.DeleteSubvolume(ctx, rootfs); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
		}
		if err := b.Store.Snapshot(ctx, parentRoot, rootfs, false); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
		}
		// The parent dropped its package indexes: fetch them again, and drop them after.
		if err := b.aptInstall(ctx, rootfs, r.packages, true, progress); err != nil {
			return storage.Release{}, Config{}, err
		}
		if err := tidyDebian(rootfs); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
		}
		if chroot, err = exec.LookPath("chroot"); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: chroot not found: %w", err)
		}
	} else {
		if err := b.debootstrap(ctx, rootfs, baseSuite, bootstrapPackages, progress); err != nil {
			return storage.Release{}, Config{}, err
		}
		if err := writeNoDocs(rootfs); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
		}
		if err := b.aptInstall(ctx, rootfs, r.packages, false, progress); err != nil {
			return storage.Release{}, Config{}, err
		}
		if chroot, err = b.customizeBase(ctx, rootfs); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
		}
	}
	if r.extra != nil {
		progress("customizing " + name)
		if err := r.extra(b, ctx, rootfs, chroot); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: %s: %w", name, err)
		}
	}
	if err := writeConfigFile(rootfs, name, BuiltinRecipeID(name), r.config); err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	cfg, err := json.Marshal(r.config)
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	rel, err := build.Commit(ctx, storage.Release{Name: name, Config: cfg})
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	progress(fmt.Sprintf("built %s: %s (%.1f MiB) in %s", name, rel.Digest, float64(rel.SizeBytes)/(1<<20), time.Since(start).Round(time.Second)))
	log.InfoContext(ctx, "template: builtin built", "template", name, "digest", rel.Digest, "size", rel.SizeBytes, "took", time.Since(start))
	return rel, r.config, nil
}

// BuildBase builds the base template (BuildBuiltin(BaseTemplate)).
func (b *Builder) BuildBase(ctx context.Context, progress func(string)) (storage.Release, error) {
	rel, _, err := b.BuildBuiltin(ctx, BaseTemplate, progress)
	return rel, err
}

// aptInstall installs packages (and what they depend on, not what they recommend) into
// rootfs, a debootstrapped tree, with the tree's own apt-get, from the mirror
// debootstrap used. It runs like debootstrap does (run: its own PID and mount
// namespaces), with /proc of that PID namespace mounted in the tree, services kept
// from starting (policy-rc.d), and the builder's package cache bind-mounted as apt's
// archive directory so packages are downloaded once per machine. Needs root and the
// mirror.
func (b *Builder) aptInstall(ctx context.Context, rootfs string, packages []string, update bool, progress func(string)) error {
	if len(packages) == 0 {
		return nil
	}
	policy := filepath.Join(rootfs, "usr/sbin/policy-rc.d")
	if err := os.WriteFile(policy, []byte("#!/bin/sh\nexit 101\n"), 0o755); err != nil {
		return fmt.Errorf("template: %w", err)
	}
	defer os.Remove(policy)
	script := `set -e
root=$1; cache=$2; update=$3; shift 3
mount -t proc proc "$root/proc"
if [ -n "$cache" ]; then
  mkdir -p "$cache/partial" "$root/var/cache/apt/archives"
  mount --bind "$cache" "$root/var/cache/apt/archives"
fi
if [ "$update" = 1 ]; then
  # The tree's resolv.conf is empty (a sandbox's runtime provides one): borrow the
  # host's for this namespace only.
  mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
  chroot "$root" apt-get -q update
fi
chroot "$root" apt-get -q -y -o APT::Sandbox::User=root -o Dpkg::Use-Pty=0 \
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
  -o Dpkg::Options::=--force-unsafe-io \
  --no-install-recommends install "$@"
`
	cache := ""
	if b.CacheDir != "" {
		abs, err := filepath.Abs(b.CacheDir)
		if err != nil {
			return fmt.Errorf("template: %w", err)
		}
		if err := os.MkdirAll(abs, 0o755); err != nil {
			return fmt.Errorf("template: %w", err)
		}
		cache = abs
	}
	progress(fmt.Sprintf("I: installing %d packages with apt-get: %s", len(packages), strings.Join(packages, " ")))
	upd := "0"
	if update {
		upd = "1"
	}
	args := append([]string{"-c", script, "apt-install", rootfs, cache, upd}, packages...)
	if err := b.runInTarget(ctx, progress, rootfs, "/bin/sh", args...); err != nil {
		return fmt.Errorf("template: apt-get install: %w", err)
	}
	return nil
}

// noDocs is dpkg configuration that leaves documentation, manual pages and message
// translations out of the tree (copyright files stay), as Debian's slim container images
// do: a third of the packages' files, read by no program. It stays in the release, so
// packages a sandbox installs later follow it too.
const noDocs = `# space builtin templates: no documentation, manual pages or translations.
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
`

func writeNoDocs(rootfs string) error {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	if err := root.MkdirAll("etc/dpkg/dpkg.cfg.d", 0o755); err != nil {
		return err
	}
	return root.WriteFile("etc/dpkg/dpkg.cfg.d/01-space-nodoc", []byte(noDocs), 0o644)
}

// configRecord is what ConfigFile holds.
type configRecord struct {
	Name string `json:"name"`
	// Recipe is the BuiltinRecipeID of a builtin release (empty for others).
	Recipe string `json:"recipe,omitempty"`
	Config Config `json:"config"`
}

// writeConfigFile records the release's name, recipe and config in its tree
// (ConfigFile).
func writeConfigFile(rootfs, name, recipe string, cfg Config) error {
	rec, err := json.MarshalIndent(configRecord{Name: name, Recipe: recipe, Config: cfg}, "", "  ")
	if err != nil {
		return err
	}
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	if err := root.MkdirAll(filepath.Dir(ConfigFile), 0o755); err != nil {
		return err
	}
	_ = root.Remove(ConfigFile)
	return root.WriteFile(ConfigFile, append(rec, '\n'), 0o644)
}

// ReadConfigFile reads the config a release recorded in its tree (ConfigFile), given
// the release's root filesystem. A release without one has an empty config.
func ReadConfigFile(rootfs string) (Config, error) {
	rec, err := readConfigRecord(rootfs)
	return rec.Config, err
}

func readConfigRecord(rootfs string) (configRecord, error) {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return configRecord{}, err
	}
	defer root.Close()
	data, err := root.ReadFile(ConfigFile)
	if errors.Is(err, os.ErrNotExist) {
		return configRecord{}, nil
	}
	if err != nil {
		return configRecord{}, err
	}
	var rec configRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		return configRecord{}, fmt.Errorf("template: %s: %w", ConfigFile, err)
	}
	return rec, nil
}

// builtinParent returns the newest release of builtin template name in the store built
// from the current recipe, building it first if there is none.
func (b *Builder) builtinParent(ctx context.Context, name string, progress func(string)) (storage.Release, error) {
	rels, err := b.Store.ListReleases()
	if err != nil {
		return storage.Release{}, fmt.Errorf("template: %w", err)
	}
	want := BuiltinRecipeID(name)
	var best *storage.Release
	for i := range rels {
		if rels[i].Name != name || (best != nil && !rels[i].CreatedAt.After(best.CreatedAt)) {
			continue
		}
		root, err := b.Store.ReleaseRoot(rels[i].Digest)
		if err != nil {
			continue
		}
		if rec, err := readConfigRecord(root); err == nil && rec.Recipe == want {
			best = &rels[i]
		}
	}
	if best != nil {
		return *best, nil
	}
	progress(fmt.Sprintf("I: building %s first", name))
	rel, _, err := b.BuildBuiltin(ctx, name, progress)
	return rel, err
}

// customizeCodeInterpreter installs the code interpreter server and warms the caches
// its first run would otherwise fill (matplotlib's font list: seconds per sandbox).
func customizeCodeInterpreter(b *Builder, ctx context.Context, rootfs, chroot string) error {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	rel := strings.TrimPrefix(codeinterp.Path, "/")
	if err := root.MkdirAll(filepath.Dir(rel), 0o755); err != nil {
		return err
	}
	if err := root.WriteFile(rel, codeinterp.Server, 0o755); err != nil {
		return err
	}
	if err := root.Chmod(rel, 0o755); err != nil {
		return err
	}
	if err := b.runInTarget(ctx, nil, rootfs, chroot, "--userspec="+baseUID+":"+baseUID, rootfs, "/usr/bin/env", "HOME="+baseHome,
		"MPLBACKEND=Agg", "/usr/bin/python3", "-c", "import matplotlib.pyplot, pandas"); err != nil {
		return fmt.Errorf("warm matplotlib's cache: %w", err)
	}
	return nil
}
