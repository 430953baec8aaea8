package template_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacedev/space/internal/template"
	"github.com/spacedev/space/internal/template/templatetest"
)

func TestZZDebianManual(t *testing.T) {
	s := templatetest.Store(t)
	b := &template.Builder{Store: s, CacheDir: filepath.Join(templatetest.CacheDir(t), "debootstrap")}
	spec, err := template.ParseSpec([]byte("name: deb\nfrom: {debian: {suite: bookworm, packages: [procps]}}\nconfig: {env: {A: b}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	rel, cfg, err := b.Build(context.Background(), spec, template.BuildOptions{Progress: func(l string) { n++ }})
	if err != nil {
		t.Fatal(err)
	}
	root, _ := s.ReleaseRoot(rel.Digest)
	for _, p := range []string{"usr/bin/ps", ".space/template.json", "run/space"} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Error(err)
		}
	}
	b2, _ := os.ReadFile(filepath.Join(root, "etc/resolv.conf"))
	lists, _ := filepath.Glob(filepath.Join(root, "var/lib/apt/lists/*_*"))
	t.Logf("%s %d MiB, %d log lines, cfg %+v, resolv %q, lists %d", rel.Digest, rel.SizeBytes>>20, n, cfg, b2, len(lists))
}
