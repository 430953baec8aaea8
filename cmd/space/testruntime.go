//go:build failpoints

package main

import (
	"encoding/json"
	"log/slog"
	"path/filepath"

	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/fake"
)

// fakeBase is the base release a test server's directory store starts with.
const fakeBase = "sha256:" + "5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace5ace"

// testRuntime is --runtime fake of a test build: the real agent as plain host
// processes and a directory store (internal/runtime/fake), so that the crash walk can
// kill and restart a real space serve without root. It isolates nothing.
func testRuntime(dataDir, agentPath string, log *slog.Logger) (runtime.Runtime, node.Disk, error) {
	rt, err := fake.New(fake.Config{Dir: filepath.Join(dataDir, "fake"), AgentPath: agentPath})
	if err != nil {
		return nil, nil, err
	}
	disk, err := fake.NewDisk(filepath.Join(dataDir, "fakestore"))
	if err != nil {
		return nil, nil, err
	}
	if !disk.HasRelease(fakeBase) {
		cfg, _ := json.Marshal(map[string]any{"user": "user", "workdir": "/home/user"})
		if _, err := disk.AddRelease(node.BaseTemplate, fakeBase, cfg, map[string]string{"etc/os-release": "ID=fake\n"}); err != nil {
			return nil, nil, err
		}
	}
	log.Warn("TEST BUILD: --runtime fake runs sandbox commands as host processes, without isolation")
	return rt, disk, nil
}
