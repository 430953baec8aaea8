package initramfs

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
)

func writeFile(t *testing.T, p, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestResolveModules(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "modules.dep"), strings.Join([]string{
		"kernel/drivers/virtio/virtio_ring.ko:",
		"kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko",
		"kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko",
		"kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko",
		"kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko",
		"",
	}, "\n"))
	writeFile(t, filepath.Join(dir, "modules.builtin"), "kernel/fs/ext4/ext4.ko\n")
	want := []string{"virtio_mmio", "virtio_blk", "virtio_console", "virtio_rng", "ext4"}
	optional := func(name string) bool { return name == "virtio_rng" }
	got, err := ResolveModules(dir, want, optional)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range got {
		rel, _ := filepath.Rel(dir, p)
		names = append(names, filepath.Base(rel))
	}
	wantFiles := []string{"virtio_ring.ko", "virtio.ko", "virtio_mmio.ko", "virtio_blk.ko", "virtio_console.ko"}
	if !slices.Equal(names, wantFiles) {
		t.Errorf("modules %v, want %v (dependencies first, built-ins and a missing optional module skipped)", names, wantFiles)
	}
	if _, err := ResolveModules(dir, want, nil); err == nil {
		t.Error("a missing module resolved without being optional")
	}
	if _, err := ResolveModules(dir, []string{"virtio_net"}, optional); err == nil {
		t.Error("a missing required module resolved")
	}
	if got, err := ResolveModules(t.TempDir(), want, nil); err != nil || len(got) != 0 {
		t.Errorf("kernel without modules.dep: %v %v, want everything built in", got, err)
	}
}

func TestWrite(t *testing.T) {
	cpio, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("needs cpio")
	}
	dir := t.TempDir()
	agent := filepath.Join(dir, "agent")
	writeFile(t, agent, "#!agent\n")
	mods := []string{filepath.Join(dir, "m/virtio.ko"), filepath.Join(dir, "m/virtio-rng.ko")}
	for _, m := range mods {
		writeFile(t, m, "module "+filepath.Base(m))
	}
	var buf bytes.Buffer
	if err := Write(&buf, agent, mods); err != nil {
		t.Fatal(err)
	}
	if buf.Len()%4 != 0 {
		t.Errorf("archive length %d not 4-aligned", buf.Len())
	}
	list := exec.Command(cpio, "-itv", "--quiet")
	list.Stdin = bytes.NewReader(buf.Bytes())
	out, err := list.CombinedOutput()
	if err != nil {
		t.Fatalf("cpio -t: %v\n%s", err, out)
	}
	for _, want := range []string{
		`-rwxr-xr-x .* 8 .* init$`, `crw------- .* 5, +1 .* dev/console$`, `crw-rw-rw- .* 1, +3 .* dev/null$`,
		`drwxr-xr-x .* proc$`, `-rw-r--r-- .* modules/virtio-rng.ko$`, `-rw-r--r-- .* modules/order$`,
	} {
		if !regexpMatchLine(want, string(out)) {
			t.Errorf("no entry matching %q in:\n%s", want, out)
		}
	}
	extract := exec.Command(cpio, "-i", "--quiet", "--to-stdout", "modules/order")
	extract.Stdin = bytes.NewReader(buf.Bytes())
	order, err := extract.Output()
	if err != nil || string(order) != "virtio.ko\nvirtio-rng.ko\n" {
		t.Errorf("modules/order: %q %v", order, err)
	}
}

func regexpMatchLine(pattern, text string) bool {
	re := regexp.MustCompile(pattern)
	for _, line := range strings.Split(text, "\n") {
		if re.MatchString(line) {
			return true
		}
	}
	return false
}

func TestCache(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	agent := filepath.Join(dir, "agent")
	writeFile(t, agent, "#!agent\n")
	mod := filepath.Join(dir, "m/virtio.ko")
	writeFile(t, mod, "module")
	kernel := filepath.Join(dir, "vmlinuz")
	writeFile(t, kernel, "kernel")

	c := &Cache{Dir: filepath.Join(dir, "cache"), KernelPath: kernel, Modules: []string{mod}}
	imgs := make([]string, 8)
	var wg sync.WaitGroup
	for i := range imgs {
		wg.Go(func() {
			img, err := c.Build(ctx, agent)
			if err != nil {
				t.Error(err)
			}
			imgs[i] = img
		})
	}
	wg.Wait()
	img := imgs[0]
	for _, other := range imgs {
		if other != img {
			t.Fatalf("concurrent builds gave %v", imgs)
		}
	}
	var want bytes.Buffer
	if err := Write(&want, agent, []string{mod}); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(img); err != nil || !bytes.Equal(got, want.Bytes()) {
		t.Errorf("image %s differs from Write's archive (%v)", img, err)
	}
	entries, _ := os.ReadDir(c.Dir)
	if len(entries) != 1 {
		t.Errorf("cache dir holds %d entries, want the image alone", len(entries))
	}
	if fi, err := os.Stat(img); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("image mode %v %v, want 0600", fi.Mode(), err)
	}

	// A new agent binary (or kernel) gets a new image; the old one stays.
	writeFile(t, agent, "#!agent v2\n")
	img2, err := c.Build(ctx, agent)
	if err != nil || img2 == img {
		t.Errorf("new agent: image %s %v, want one other than %s", img2, err, img)
	}
	if _, err := os.Stat(img); err != nil {
		t.Errorf("old image: %v", err)
	}
	writeFile(t, kernel, "kernel v2")
	if img3, err := c.Build(ctx, agent); err != nil || img3 == img2 {
		t.Errorf("new kernel: image %s %v, want one other than %s", img3, err, img2)
	}

	// Without a kernel the key leaves it out; world-readable caches are.
	pub := &Cache{Dir: filepath.Join(dir, "pub"), Modules: []string{mod}, WorldReadable: true}
	img4, err := pub.Build(ctx, agent)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, kernel, "kernel v3")
	if again, err := pub.Build(ctx, agent); err != nil || again != img4 {
		t.Errorf("cache without a kernel rebuilt for a new kernel: %s %v", again, err)
	}
	if fi, err := os.Stat(img4); err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("world-readable image mode %v %v, want 0644", fi.Mode(), err)
	}
	if fi, err := os.Stat(pub.Dir); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("world-readable cache dir mode %v %v, want 0755", fi.Mode(), err)
	}

	if _, err := c.Build(ctx, filepath.Join(dir, "missing")); err == nil {
		t.Error("built an image of a missing agent")
	}
}
