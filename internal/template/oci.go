package template

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	goruntime "runtime"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/spacedev/space/internal/fault"
)

// platform is the platform images are selected for: this host's.
func platform() v1.Platform { return v1.Platform{OS: "linux", Architecture: goruntime.GOARCH} }

// pullImage resolves a registry reference to an image (layers are fetched while they
// are extracted).
func pullImage(ctx context.Context, ref string, progress func(string)) (v1.Image, error) {
	r, err := parseImageRef(ref)
	if err != nil {
		return nil, fault.Wrap(fault.Invalid, err)
	}
	progress("pulling " + r.String())
	img, err := remote.Image(r, remote.WithContext(ctx), remote.WithPlatform(platform()),
		remote.WithAuthFromKeychain(authn.DefaultKeychain))
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", r, err)
	}
	return img, nil
}

// loadArchive opens a docker-archive tarball or an OCI image layout directory at p (a
// path CheckPath resolved). The image reads its file lazily: call done after use.
func loadArchive(p string) (img v1.Image, done func(), err error) {
	fi, err := os.Stat(p)
	if err != nil {
		return nil, nil, err
	}
	if fi.IsDir() {
		img, err := loadLayout(p)
		return img, func() {}, err
	}
	// Each open goes through an os.Root of the archive's directory, so a file swapped
	// for a symbolic link meanwhile cannot redirect the read out of that directory.
	dir, base := filepath.Split(p)
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, nil, err
	}
	opener := func() (io.ReadCloser, error) {
		return root.OpenFile(base, os.O_RDONLY, 0)
	}
	img, err = tarball.Image(opener, nil)
	if err != nil {
		root.Close()
		return nil, nil, fmt.Errorf("read docker-archive %s: %w", p, err)
	}
	return img, func() { root.Close() }, nil
}

// loadLayout opens an OCI image layout directory. Layouts hold no symbolic links; one
// would let the layout point reads elsewhere on the node, so any link is refused.
func loadLayout(dir string) (v1.Image, error) {
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type()&fs.ModeSymlink != 0 {
			return fault.New(fault.Forbidden, "OCI layout %s contains a symbolic link (%s); layouts must be plain files", dir, p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	l, err := layout.FromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("%s is neither a docker-archive tarball nor an OCI layout (no index.json): %w", dir, err)
	}
	idx, err := l.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("read OCI layout %s: %w", dir, err)
	}
	return pickImage(idx)
}

// pickImage selects the image for this platform from an index: the only image, or the
// one whose platform matches, looking into nested indexes.
func pickImage(idx v1.ImageIndex) (v1.Image, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	want := platform()
	var candidates []v1.Descriptor
	for _, d := range m.Manifests {
		if d.Platform == nil || d.Platform.Satisfies(want) {
			candidates = append(candidates, d)
		}
	}
	if len(candidates) == 0 {
		return nil, fmt.Errorf("the layout has no image for %s/%s", want.OS, want.Architecture)
	}
	d := candidates[0]
	if len(candidates) > 1 {
		for _, c := range candidates {
			if c.Platform != nil {
				d = c
				break
			}
		}
	}
	if d.MediaType.IsIndex() {
		child, err := idx.ImageIndex(d.Digest)
		if err != nil {
			return nil, err
		}
		return pickImage(child)
	}
	return idx.Image(d.Digest)
}

// describeImage logs the image's digest and layers.
func describeImage(img v1.Image, progress func(string)) {
	dg, err := img.Digest()
	if err != nil {
		return
	}
	layers, err := img.Layers()
	if err != nil {
		return
	}
	var total int64
	for _, l := range layers {
		if n, err := l.Size(); err == nil {
			total += n
		}
	}
	progress(fmt.Sprintf("image %s: %d layers, %.1f MiB compressed", dg, len(layers), float64(total)/(1<<20)))
}

// extractImage flattens the image's layers (whiteouts applied) into root.
func extractImage(ctx context.Context, img v1.Image, root *os.Root, progress func(string)) error {
	describeImage(img, progress)
	rc := mutate.Extract(img)
	defer rc.Close()
	st, err := extractTar(ctx, root, rc, progress)
	if err != nil {
		return fmt.Errorf("extract image: %w", err)
	}
	// mutate.Extract ends its tar stream before it reports a failure (a layer that
	// cannot be fetched or verified, an unsafe entry): the error only comes after the
	// end-of-archive marker, so read on to it.
	if _, err := io.Copy(io.Discard, rc); err != nil {
		return fmt.Errorf("extract image: %w", err)
	}
	progress(fmt.Sprintf("extracted %d files, %d directories, %d links (%.1f MiB)", st.Files, st.Dirs, st.Links, float64(st.Bytes)/(1<<20)))
	return nil
}

// imageConfig turns an OCI image config into template config defaults: Env, WorkingDir,
// User (its user part), Entrypoint+Cmd as the start command.
func imageConfig(img v1.Image) (Config, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return Config{}, fmt.Errorf("read image config: %w", err)
	}
	var c Config
	c.Env = map[string]string{}
	for _, kv := range cf.Config.Env {
		k, v, ok := strings.Cut(kv, "=")
		if ok && envKeyRe.MatchString(k) {
			c.Env[k] = v
		}
	}
	c.Workdir = cf.Config.WorkingDir
	if u, _, _ := strings.Cut(cf.Config.User, ":"); u != "" {
		c.User = u
	}
	c.Start = append(append([]string(nil), cf.Config.Entrypoint...), cf.Config.Cmd...)
	if len(c.Start) == 0 {
		c.Start = nil
	}
	return c, nil
}
