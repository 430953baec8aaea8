package template

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"strings"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/storage"
)

// ConfigFile is where a built release records its name and config inside its root
// filesystem. Being part of the tree, the config is covered by the release digest, so
// two builds that differ only in config (or name) are different releases.
const ConfigFile = ".space/template.json"

// Sandbox is a running build sandbox: a runtime instance started on the root
// filesystem being built, with space-agent as PID 1. Steps run through its agent.
type Sandbox interface {
	Agent() *agentclient.Client
	// Close stops the instance and removes what it left in the root filesystem.
	Close(ctx context.Context) error
}

// SandboxStarter starts a build sandbox on rootfs. cfg is the template's config so far
// (its resources size the sandbox).
type SandboxStarter func(ctx context.Context, rootfs string, cfg Config) (Sandbox, error)

// Parent is the release a `from: template` build starts from, resolved by the caller.
type Parent struct {
	Digest string
	Config Config
}

// BuildOptions are what the node contributes to a build.
type BuildOptions struct {
	// Progress receives the build log: source progress (debootstrap, pull, extraction)
	// and every step's output, line by line.
	Progress func(string)
	// Parent is required for a `from: template` spec.
	Parent *Parent
	// Sandbox starts build sandboxes; required when the spec has steps.
	Sandbox SandboxStarter
}

// StepError is a build step that failed; the step's output is in the build log.
type StepError struct {
	Index int // 0-based
	Step  string
	Err   error
}

func (e *StepError) Error() string {
	return fmt.Sprintf("step %d (%s) failed: %v", e.Index+1, e.Step, e.Err)
}

func (e *StepError) Unwrap() error { return e.Err }

// Build builds the release spec describes into the store and returns it with its full
// config. The sources are checked against b.Sources first (fault.Forbidden), before
// anything is written or fetched. The build happens in a tmp/ subvolume; a failed or
// cancelled build leaves nothing behind. If a release with the same content digest
// exists already, it is returned.
func (b *Builder) Build(ctx context.Context, spec *Spec, opts BuildOptions) (_ storage.Release, _ Config, err error) {
	if b.Store == nil {
		return storage.Release{}, Config{}, errors.New("template: Builder.Store is nil")
	}
	if err := spec.Validate(); err != nil {
		return storage.Release{}, Config{}, err
	}
	if err := b.Sources.CheckSpec(spec, true); err != nil {
		return storage.Release{}, Config{}, err
	}
	if spec.From.Template != "" && opts.Parent == nil {
		return storage.Release{}, Config{}, errors.New("template: a from-template build needs its parent release")
	}
	if len(spec.Steps) > 0 && opts.Sandbox == nil {
		return storage.Release{}, Config{}, errors.New("template: this node cannot run build steps (no sandbox starter)")
	}
	progress := opts.Progress
	if progress == nil {
		progress = func(string) {}
	}
	log := b.logger()

	build, err := b.Store.BeginRelease(ctx)
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	defer build.Discard(ctx)
	rootfs := build.Rootfs()
	log.InfoContext(ctx, "template: building", "template", spec.Ref(), "dir", rootfs)

	base, err := b.populate(ctx, spec, opts, build, progress)
	if err != nil {
		return storage.Release{}, Config{}, err
	}
	cfg := base.Merge(spec.Config)

	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	defer root.Close()
	// The runtimes mount the agent and its run directory there.
	for _, d := range []string{".space", "run/space"} {
		if err := root.MkdirAll(d, 0o755); err != nil {
			return storage.Release{}, Config{}, fmt.Errorf("template: create /%s in the root filesystem: %w", d, err)
		}
	}
	if len(spec.Steps) > 0 {
		if err := b.runSteps(ctx, spec, cfg, rootfs, opts.Sandbox, progress); err != nil {
			return storage.Release{}, Config{}, err
		}
	}
	rec, err := json.MarshalIndent(struct {
		Name   string `json:"name"`
		Config Config `json:"config"`
	}{spec.Name, cfg}, "", "  ")
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	_ = root.Remove(ConfigFile) // a file a step or the source put there
	if err := root.WriteFile(ConfigFile, append(rec, '\n'), 0o644); err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: write /%s: %w", ConfigFile, err)
	}
	progress("committing release")
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	rel, err := build.Commit(ctx, storage.Release{Name: spec.Name, Config: cfgJSON})
	if err != nil {
		return storage.Release{}, Config{}, fmt.Errorf("template: %w", err)
	}
	progress(fmt.Sprintf("built %s: %s (%.1f MiB)", spec.Ref(), rel.Digest, float64(rel.SizeBytes)/(1<<20)))
	log.InfoContext(ctx, "template: built", "template", spec.Ref(), "digest", rel.Digest, "size", rel.SizeBytes)
	return rel, cfg, nil
}

// populate fills the build's root filesystem from the spec's source and returns the
// config defaults the source brings.
func (b *Builder) populate(ctx context.Context, spec *Spec, opts BuildOptions, build *storage.ReleaseBuild, progress func(string)) (Config, error) {
	rootfs := build.Rootfs()
	withRoot := func(fn func(*os.Root) error) error {
		root, err := os.OpenRoot(rootfs)
		if err != nil {
			return err
		}
		defer root.Close()
		return fn(root)
	}
	from := spec.From
	switch {
	case from.Debian != nil:
		if err := b.debootstrap(ctx, rootfs, from.Debian.Suite, from.Debian.Packages, progress); err != nil {
			return Config{}, err
		}
		if err := tidyDebian(rootfs); err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		return Config{}, nil

	case from.Image != "":
		img, err := pullImage(ctx, from.Image, progress)
		if err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		cfg, err := imageConfig(img)
		if err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		if err := withRoot(func(r *os.Root) error { return extractImage(ctx, img, r, progress) }); err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		return cfg, nil

	case from.Archive != "":
		p, err := b.Sources.CheckPath("from.archive", from.Archive, true)
		if err != nil {
			return Config{}, err
		}
		progress("reading " + p)
		img, closeArchive, err := loadArchive(p)
		if err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		defer closeArchive()
		cfg, err := imageConfig(img)
		if err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		if err := withRoot(func(r *os.Root) error { return extractImage(ctx, img, r, progress) }); err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		return cfg, nil

	case from.Dir != "":
		p, err := b.Sources.CheckPath("from.dir", from.Dir, true)
		if err != nil {
			return Config{}, err
		}
		src, err := os.OpenRoot(p)
		if err != nil {
			return Config{}, fmt.Errorf("template: from.dir: %w", err)
		}
		defer src.Close()
		progress("copying " + p)
		var st extractStats
		err = withRoot(func(r *os.Root) error {
			var err error
			st, err = copyTree(ctx, src, r, progress)
			return err
		})
		if err != nil {
			return Config{}, fmt.Errorf("template: copy %s: %w", p, err)
		}
		progress(fmt.Sprintf("copied %d files, %d directories, %d links (%.1f MiB)", st.Files, st.Dirs, st.Links, float64(st.Bytes)/(1<<20)))
		return Config{}, nil

	case from.Template != "":
		parent, err := b.Store.ReleaseRoot(opts.Parent.Digest)
		if err != nil {
			return Config{}, fault.New(fault.NotFound, "template %s (%s) is not on this node", from.Template, opts.Parent.Digest)
		}
		progress(fmt.Sprintf("snapshotting %s (%s)", from.Template, opts.Parent.Digest))
		// Replace the build's empty subvolume with a writable snapshot of the parent.
		if err := b.Store.DeleteSubvolume(ctx, rootfs); err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		if err := b.Store.Snapshot(ctx, parent, rootfs, false); err != nil {
			return Config{}, fmt.Errorf("template: %w", err)
		}
		return opts.Parent.Config, nil
	}
	return Config{}, fault.New(fault.Invalid, "from names no source")
}

// tidyDebian removes what debootstrap copies from the build host (resolv.conf,
// hostname) and package indexes, which are large and soon stale.
func tidyDebian(rootfs string) error {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	if err := root.WriteFile("etc/resolv.conf", nil, 0o644); err != nil {
		return err
	}
	if err := root.WriteFile("etc/hostname", []byte("sandbox\n"), 0o644); err != nil {
		return err
	}
	for _, dir := range []string{"var/lib/apt/lists", "var/cache/apt"} {
		ents, err := fs.ReadDir(root.FS(), dir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			n := e.Name()
			if (dir == "var/lib/apt/lists" && strings.Contains(n, "_")) || (dir == "var/cache/apt" && path.Ext(n) == ".bin") {
				if err := root.Remove(path.Join(dir, n)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
