package template_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacedev/space/internal/template"
	"github.com/spacedev/space/internal/template/templatetest"
)

// TestBuildDebianSpec builds a spec from a Debian suite (real debootstrap, sharing the
// package cache with the base build): packages installed, host files tidied, the
// config recorded in the tree, nothing left in tmp/.
func TestBuildDebianSpec(t *testing.T) {
	requireBuild(t)
	s := templatetest.Store(t)
	b := &template.Builder{Store: s, CacheDir: filepath.Join(templatetest.CacheDir(t), "debootstrap")}
	spec, err := template.ParseSpec([]byte("name: deb\nfrom: {debian: {suite: bookworm, packages: [procps]}}\nconfig: {env: {A: b}, workdir: /srv}\n"))
	if err != nil {
		t.Fatal(err)
	}
	var lines int
	rel, cfg, err := b.Build(context.Background(), spec, template.BuildOptions{Progress: func(string) { lines++ }})
	if err != nil {
		t.Fatal(err)
	}
	relCfg, err := template.ParseConfig(rel.Config)
	if err != nil {
		t.Fatal(err)
	}
	if rel.Name != "deb" || relCfg.Env["A"] != "b" || relCfg.Workdir != "/srv" || cfg.Env["A"] != "b" || lines < 3 {
		t.Errorf("release %+v, config %+v, %d log lines", rel, cfg, lines)
	}
	root, err := s.ReleaseRoot(rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"usr/bin/ps", "run/space", ".space"} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Error(err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(root, "etc/resolv.conf")); err != nil || len(b) != 0 {
		t.Errorf("resolv.conf = %q, %v", b, err)
	}
	if lists, _ := filepath.Glob(filepath.Join(root, "var/lib/apt/lists/*_*")); len(lists) != 0 {
		t.Errorf("package lists left: %v", lists)
	}
	var rec struct {
		Name   string          `json:"name"`
		Config template.Config `json:"config"`
	}
	data, err := os.ReadFile(filepath.Join(root, template.ConfigFile))
	if err != nil || json.Unmarshal(data, &rec) != nil || rec.Name != "deb" || rec.Config.Workdir != "/srv" {
		t.Errorf("%s = %s, %v", template.ConfigFile, data, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Root(), "tmp")); len(ents) != 0 {
		t.Errorf("tmp after the build: %v", ents)
	}
}
