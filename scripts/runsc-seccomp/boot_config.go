//go:build ignore

// This file is copied into gVisor's runsc/boot/filter/config package (without the
// build line above) by scripts/setup.sh when it builds runsc; see gen.go.

package config

import (
	"fmt"

	"gvisor.dev/gvisor/pkg/seccomp"
	"gvisor.dev/gvisor/pkg/seccomp/precompiledseccomp"
)

// SpacePrecompiledPrograms is PrecompiledPrograms restricted to the option sets a
// space node can use: every platform, network and file system variant, and no
// GPU, TPU or RDMA proxy (space never passes those flags). Upstream's Bazel build
// precompiles the full cross product, some hundreds of programs; this keeps the
// build at seconds.
func SpacePrecompiledPrograms() ([]precompiledseccomp.Program, error) {
	opts, err := optionsToPrecompile()
	if err != nil {
		return nil, err
	}
	var programs []precompiledseccomp.Program
	for _, opt := range opts {
		if opt.NVProxy || opt.TPUProxy || opt.RDMAProxy {
			continue
		}
		var varNames []string
		for varName := range opt.Vars() {
			varNames = append(varNames, varName)
		}
		program, err := precompiledseccomp.Precompile(opt.ConfigKey(), varNames, func(vars precompiledseccomp.Values) *seccomp.Program {
			rules, denyRules := rules(opt, vars)
			return &seccomp.Program{
				RuleSets: []seccomp.RuleSet{
					{Rules: denyRules.Copy()},
					{Rules: rules.Copy(), Action: seccomp.Allow},
				},
				Options: SeccompOptions(opt),
			}
		})
		if err != nil {
			return nil, fmt.Errorf("precompile seccomp program for options %v: %w", opt.ConfigKey(), err)
		}
		programs = append(programs, program)
	}
	return programs, nil
}
