package pgmanaged

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// debianLibRoot is where Debian's postgresql-NN packages install their server binaries
// (they are not on PATH there: only the pg_wrapper client scripts are).
const debianLibRoot = "/usr/lib/postgresql"

// binaries are the server programs pgmanaged runs.
type binaries struct {
	dir      string
	initdb   string
	postgres string
}

// errNoBinaries names the Debian packages because that is the fix on the hosts space
// targets.
var errNoBinaries = errors.New("PostgreSQL server binaries (initdb, postgres) not found on PATH or under " +
	debianLibRoot + "/*/bin: install the Debian package postgresql-15 (or postgresql), or set the binary directory")

// findBinaries picks the directory holding initdb and postgres: binDir when given;
// otherwise, for an existing cluster, the installed version matching its PG_VERSION
// (a newer major version cannot open it); otherwise initdb on PATH; otherwise the highest
// version under libRoot.
func findBinaries(binDir, libRoot, dataDir string) (binaries, error) {
	if binDir != "" {
		b, err := binariesIn(binDir)
		if err != nil {
			return binaries{}, fmt.Errorf("bin dir %s: %w", binDir, err)
		}
		return b, nil
	}
	if v, err := os.ReadFile(filepath.Join(dataDir, "PG_VERSION")); err == nil {
		if b, err := binariesIn(filepath.Join(libRoot, strings.TrimSpace(string(v)), "bin")); err == nil {
			return b, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if b, err := binariesIn(filepath.Dir(p)); err == nil {
			return b, nil
		}
	}
	dirs, _ := filepath.Glob(filepath.Join(libRoot, "*", "bin")) // Glob errs only on a bad pattern
	sort.Slice(dirs, func(i, j int) bool {
		return versionLess(versionOf(dirs[j]), versionOf(dirs[i]))
	})
	for _, d := range dirs {
		if b, err := binariesIn(d); err == nil {
			return b, nil
		}
	}
	return binaries{}, errNoBinaries
}

func binariesIn(dir string) (binaries, error) {
	b := binaries{dir: dir, initdb: filepath.Join(dir, "initdb"), postgres: filepath.Join(dir, "postgres")}
	for _, p := range []string{b.initdb, b.postgres} {
		fi, err := os.Stat(p)
		if err != nil {
			return binaries{}, err
		}
		if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
			return binaries{}, fmt.Errorf("%s is not executable", p)
		}
	}
	return b, nil
}

// versionOf turns ".../15/bin" or ".../9.6/bin" into its numeric parts.
func versionOf(binDir string) []int {
	var v []int
	for _, s := range strings.Split(filepath.Base(filepath.Dir(binDir)), ".") {
		n, err := strconv.Atoi(s)
		if err != nil {
			return nil // not a version directory: sorts lowest
		}
		v = append(v, n)
	}
	return v
}

func versionLess(a, b []int) bool {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return len(a) < len(b)
}
