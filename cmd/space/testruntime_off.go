//go:build !failpoints

package main

import (
	"errors"
	"log/slog"

	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/runtime"
)

// testRuntime is only in test builds (-tags failpoints): see testruntime.go.
func testRuntime(string, string, *slog.Logger) (runtime.Runtime, node.Disk, error) {
	return nil, nil, errors.New("--runtime fake exists only in test builds (-tags failpoints)")
}
