package vmboot

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ModuleName is the kernel's name of a module file: the base name without .ko (and a
// compression suffix), dashes as underscores ("virtio-rng.ko" → "virtio_rng").
func ModuleName(file string) string {
	base := filepath.Base(file)
	if i := strings.Index(base, ".ko"); i >= 0 {
		base = base[:i]
	}
	return strings.ReplaceAll(base, "-", "_")
}

// moduleParams collects module parameters from the kernel command line: the kernel
// applies <mod>.<param>=<value> itself only to built-in modules; for loadable ones
// modprobe normally does it.
func moduleParams(cmdline []string) map[string]string {
	params := map[string]string{}
	for _, arg := range cmdline {
		key, _, _ := strings.Cut(arg, "=")
		mod, param, ok := strings.Cut(key, ".")
		if !ok || mod == "" || param == "" || strings.Contains(mod, "/") {
			continue
		}
		rest := arg[len(mod)+1:]
		mod = strings.ReplaceAll(mod, "-", "_")
		if p := params[mod]; p != "" {
			rest = p + " " + rest
		}
		params[mod] = rest
	}
	return params
}

// LoadModules loads the modules named in orderFile (one file name per line, relative to
// the file's directory, dependencies first) with finit_module(2), giving each its
// parameters from params (keyed by ModuleName). A module the kernel already has is
// skipped; a missing order file means there is nothing to load. It returns the names of
// the modules it loaded.
func LoadModules(orderFile string, params map[string]string) ([]string, error) {
	f, err := os.Open(orderFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("modules: %w", err)
	}
	defer f.Close()
	var loaded []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		file := strings.TrimSpace(sc.Text())
		if file == "" || strings.HasPrefix(file, "#") {
			continue
		}
		name := ModuleName(file)
		ok, err := loadModule(filepath.Join(filepath.Dir(orderFile), file), params[name])
		if err != nil {
			return loaded, fmt.Errorf("modules: load %s: %w", name, err)
		}
		if ok {
			loaded = append(loaded, name)
		}
	}
	if err := sc.Err(); err != nil {
		return loaded, fmt.Errorf("modules: %w", err)
	}
	return loaded, nil
}

// loadModule loads one module file; false when the kernel already had it.
func loadModule(path, params string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	flags := 0
	if !strings.HasSuffix(path, ".ko") {
		// .ko.xz, .ko.zst, .ko.gz: the kernel decompresses (CONFIG_MODULE_DECOMPRESS).
		flags |= unix.MODULE_INIT_COMPRESSED_FILE
	}
	err = unix.FinitModule(int(f.Fd()), params, flags)
	if errors.Is(err, unix.EEXIST) {
		return false, nil
	}
	return err == nil, err
}
