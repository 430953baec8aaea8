// Package crash names the instants at which space is tested for crashes: every step of
// every lifecycle transition (and of pool fills and claims, template builds and base
// snapshots) calls Point with a stable name, like "suspend.checkpointed".
//
// In normal builds Point does nothing and costs nothing. Test builds made with
// `-tags failpoints` act on the points (failpoints.go): the crash walk in
// internal/crashtest runs each transition once recording the points it passes, then
// once per point with the process killed there (kill -9 semantics) or its PostgreSQL
// killed there, restarts, and checks that nothing was lost. This is the same idea as
// etcd's gofail, without a code generator: a build tag selects the implementation.
package crash

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
)

// Arm writes the arm file at path (a failpoints build's SPACE_CRASH_ARM): the process
// takes action ("kill": SIGKILL itself; "pgkill": SIGKILL its PostgreSQL) at point,
// once — the action creates the file once first, holding the point and the pid that
// took it, and is not taken while that file exists. An empty point disarms (the file
// is removed). The file is replaced whole, so a point never reads half of it.
func Arm(path, point, action, once string) error {
	if point == "" {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	}
	spec := strings.Join([]string{point, action, once}, " ")
	if len(strings.Fields(spec)) != 3 {
		return fmt.Errorf("crash: arm %q: point, action and once-file must be single words", spec)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(spec+"\n"), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
