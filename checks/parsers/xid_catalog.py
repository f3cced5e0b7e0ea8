"""NVIDIA's whole Xid catalog (Ampere and newer), each code with NVIDIA's resolution buckets, and the
verdict preflight gives it.

Source: NVIDIA, "Xid Errors" — "Analyzing Xid Errors with the Xid Catalog", Table 1 "Xids" (codes 1-172:
mnemonic, description, Resolution Bucket (Immediate Action), Resolution Bucket (Investigatory Action)) and
the "Guidance Classes" sheet, https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (the
same data as https://docs.nvidia.com/Xid-Catalog.xlsx). Codes are transcribed as published; "Unused" is the
catalog's own word for codes deprecated on current GPUs (V100 or earlier). The bucket explanations below
are ours, in short, after the Guidance Classes sheet.

Why a verdict needs more than the catalog: the catalog's immediate action says what recovers the GPU, and
preflight asks whether a node may join a training job. A node fails when the action takes the GPU out of
service (reset, reboot, reseat, NVLink workflow, the DBE workflow), or when Azure's node health checks
(azurehpc-health-checks `check_gpu_xid`, ../shared/notes/preflight.md §3) drain on the code; every other known code
warns (the application's fault, or nothing to do). A code the catalog does not hold warns as unknown:
never passed in silence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
SOURCE = f"NVIDIA Xid catalog ({CATALOG_URL})"

#: NVIDIA's resolution buckets (Guidance Classes), what each asks for, in our words.
BUCKETS: dict[str, str] = {
    "CONTACT_SUPPORT": "contact NVIDIA support",
    "RESTART_APP": "restart the application; no GPU reset needed",
    "IGNORE": "no action needed",
    "RESET_GPU": "reset the GPU (drain it first)",
    "RESTART_BM": "reboot the node",
    "RESTART_VM": "restart the VM that owns the GPU",
    "RESTART_FM": "restart the fabric manager",
    "CHECK_MECHANICALS": "check the GPU's seating and power connections",
    "UPDATE_SWFW": "update driver and firmware (vGPU guest/host mismatch or unsupported vGPU type)",
    "CHECK_UVM": "reset the GPU if UVM/vGPU is in use, else nothing",
    "CHECK_APP/CUDA": "the application likely sent bad data or methods; the message's pid names it",
    "INVESTIGATE_SW": "investigate the user's or NVIDIA's software; the pid names the origin",
    "INVESTIGATE_SW_USER": "investigate software or a user action, if unexpected",
    "INVESTIGATE_LINK_SI": "investigate the NVLink's signal integrity (GB200 resiliency service flow)",
    "XID_137_FLOW": "an illegal NVLink peer access: run the application under compute-sanitizer or cuda-gdb",
    "IGNORE (sympathetic)": "a sympathetic error: resolve the Xid that came with it first",
    "SYMPATHETIC_REPORT_SOLO": "a sympathetic error: resolve the Xid that came with it; report it if alone",
    "WORKFLOW_XID_13": "repeating on one TPC/GPC: run DCGM's EUD (possible hardware), else check the application",
    "WORKFLOW_XID_31": "repeating MMU faults on one GPU: run DCGM's EUD (possible hardware), else check the application",
    "WORKFLOW_XID_45": "alone: restart the fabric manager; with another Xid: follow that one",
    "WORKFLOW_XID_48": "reset the GPU (drain and reset with Xid 63/64); alone: run the field diagnostics",
    "WORKFLOW_NVLINK_ERR": "decode the message's NVLink registers; reset the GPU or reboot to clear it",
    "WORKFLOW_NVLINK5_ERR": "decode the message's IntrInfo / error status (the catalog's 144-150 table) for the action",
    "XID_154": "follow the recovery action the message names",
    "": "the catalog gives no action",
}
#: immediate actions that take the GPU out of service: the node fails preflight
OUT_OF_SERVICE = frozenset({"RESET_GPU", "RESTART_BM", "RESTART_VM", "CHECK_MECHANICALS", "UPDATE_SWFW",
                            "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR", "WORKFLOW_NVLINK5_ERR"})
#: codes Azure's node health checks drain on (azurehpc-health-checks check_gpu_xid; ../shared/notes/preflight.md §3)
AZURE_CRITICAL = frozenset({48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120})


@dataclass(frozen=True)
class XidEntry:
    code: int
    mnemonic: str
    description: str   # "Unused": deprecated on current GPUs, as the catalog says
    immediate: str     # Resolution Bucket (Immediate Action); "" where the catalog gives none
    investigatory: str  # Resolution Bucket (Investigatory Action)
    note: str = ""     # the catalog's advice where it has no bucket (codes 162-172), in short


# code | mnemonic | description | immediate | investigatory   (one row per code of Table 1)
_TABLE = """
1|ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD|Unused|CONTACT_SUPPORT|
2|ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD|Unused|CONTACT_SUPPORT|
3|ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD|Unused|CONTACT_SUPPORT|
4|ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY|Unused|CONTACT_SUPPORT|
5|ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW|Unused|CONTACT_SUPPORT|
6|ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR|Unused|CONTACT_SUPPORT|
7|ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR|Unused|CONTACT_SUPPORT|
8|ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT|GPU stopped processing|RESTART_APP|CONTACT_SUPPORT
9|ROBUST_CHANNEL_GR_ERROR_INSTANCE|Unused|CONTACT_SUPPORT|
10|ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP|Unused|CONTACT_SUPPORT|
11|ROBUST_CHANNEL_GR_ERROR_MISSING_HW|Invalid or corrupted push buffer stream|RESTART_APP|CHECK_APP/CUDA
12|ROBUST_CHANNEL_GR_ERROR_SW_METHOD|Unused|CONTACT_SUPPORT|
13|ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY|Graphics Engine Exception|RESTART_APP|WORKFLOW_XID_13
14|ROBUST_CHANNEL_FAKE_ERROR|Fake or injected error from userspace|IGNORE|CONTACT_SUPPORT
15|ROBUST_CHANNEL_SCANLINE_TIMEOUT|Unused|CONTACT_SUPPORT|
16|ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT|Unused|CONTACT_SUPPORT|CONTACT_SUPPORT
17|ROBUST_CHANNEL_PARAMETER_ERROR|Unused|CONTACT_SUPPORT|
18|ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR|Unused|CONTACT_SUPPORT|
19|ROBUST_CHANNEL_DISP_MISSED_NOTIFIER|Unused|CONTACT_SUPPORT|
20|ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD|Unused|CONTACT_SUPPORT|
21|ROBUST_CHANNEL_ME_ERROR_SW_METHOD|Unused|CONTACT_SUPPORT|
22|ROBUST_CHANNEL_VP_ERROR_SW_METHOD|Unused|CONTACT_SUPPORT|
23|ROBUST_CHANNEL_RC_LOGGING_ENABLED|Unused|CONTACT_SUPPORT|
24|ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT|Unused|CONTACT_SUPPORT|
25|ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY|Invalid or illegal push buffer stream|RESTART_APP|CHECK_APP/CUDA
26|ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT|Unused|CONTACT_SUPPORT|
27|ROBUST_CHANNEL_VP_ERROR|Unused|CONTACT_SUPPORT|
28|ROBUST_CHANNEL_VP2_ERROR|Unused|CONTACT_SUPPORT|
29|ROBUST_CHANNEL_BSP_ERROR|Unused|CONTACT_SUPPORT|
30|ROBUST_CHANNEL_BAD_ADDR_ACCESS|Unused|CONTACT_SUPPORT|
31|ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT|GPU memory page fault|RESTART_APP|WORKFLOW_XID_31
32|ROBUST_CHANNEL_PBDMA_ERROR|Invalid or corrupted push buffer stream|RESTART_APP|CHECK_APP/CUDA
33|ROBUST_CHANNEL_SEC_ERROR|Unused|CONTACT_SUPPORT|
34|ROBUST_CHANNEL_MSVLD_ERROR|Unused|CONTACT_SUPPORT|
35|ROBUST_CHANNEL_MSPDEC_ERROR|Unused|CONTACT_SUPPORT|
36|ROBUST_CHANNEL_MSPPP_ERROR|Unused|CONTACT_SUPPORT|
37|ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD|Driver firmware error|IGNORE|CHECK_APP/CUDA
38|ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT|Driver firmware error|IGNORE|CONTACT_SUPPORT
39|ROBUST_CHANNEL_CE0_ERROR|Copy Engine Exception|RESTART_APP|CONTACT_SUPPORT
40|ROBUST_CHANNEL_CE1_ERROR|Copy Engine Exception|RESTART_APP|CONTACT_SUPPORT
41|ROBUST_CHANNEL_CE2_ERROR|Copy Engine Exception|RESTART_APP|CONTACT_SUPPORT
42|ROBUST_CHANNEL_VIC_ERROR|Unused|CONTACT_SUPPORT|
43|ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR|GPU stopped processing|IGNORE|CONTACT_SUPPORT
44|ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW|Graphics Engine fault during context switch|IGNORE|CONTACT_SUPPORT
45|ROBUST_CHANNEL_PREEMPTIVE_REMOVAL|Preemptive cleanup, due to previous errors|WORKFLOW_XID_45|WORKFLOW_XID_45
46|ROBUST_CHANNEL_GPU_TIMEOUT_ERROR|GPU stopped processing|RESET_GPU|CONTACT_SUPPORT
47|ROBUST_CHANNEL_NVENC0_ERROR|Unused|CONTACT_SUPPORT|
48|ROBUST_CHANNEL_GPU_ECC_DBE|Double Bit ECC Error|WORKFLOW_XID_48|WORKFLOW_XID_48
49|SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY|Unused|CONTACT_SUPPORT|
50|SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR|Unused|CONTACT_SUPPORT|
51|SILENT_RUNNING_STRESS_TEST_FAILURE|Unused|CONTACT_SUPPORT|
52|SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE|Unused|CONTACT_SUPPORT|
53|SILENT_RUNNING_TEMP_REDUCED_CLOCKING|Unused|CONTACT_SUPPORT|
54|SILENT_RUNNING_PWR_REDUCED_CLOCKING|Auxiliary power is not connected to the GPU board|CHECK_MECHANICALS|CONTACT_SUPPORT
55|SILENT_RUNNING_TEMPERATURE_READ_ERROR|Unused|CONTACT_SUPPORT|
56|DISPLAY_CHANNEL_EXCEPTION|Unused|CONTACT_SUPPORT|
57|FB_LINK_TRAINING_FAILURE_ERROR|Unused|CONTACT_SUPPORT|
58|FB_MEMORY_ERROR|Unused|CONTACT_SUPPORT|
59|PMU_ERROR|Unused|CONTACT_SUPPORT|
60|ROBUST_CHANNEL_SEC2_ERROR|Video processor exception|RESTART_APP|INVESTIGATE_SW
61|PMU_BREAKPOINT|Unused|CONTACT_SUPPORT|
62|PMU_HALT_ERROR|Internal micro-controller halt (newer drivers)|RESET_GPU|CONTACT_SUPPORT
63|INFOROM_DRAM_RETIREMENT_EVENT|GPU memory remapping event|IGNORE|IGNORE
64|INFOROM_DRAM_RETIREMENT_FAILURE|GPU memory remapping failure|RESET_GPU|CONTACT_SUPPORT
65|ROBUST_CHANNEL_NVENC1_ERROR|Unused|CONTACT_SUPPORT|
66|ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION|Illegal access by driver|IGNORE|INVESTIGATE_SW
67|ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION|Illegal access by driver|IGNORE|CONTACT_SUPPORT
68|ROBUST_CHANNEL_NVDEC0_ERROR|NVDEC0 Exception|RESTART_APP|CONTACT_SUPPORT
69|ROBUST_CHANNEL_GR_CLASS_ERROR|Graphics Engine class error|RESTART_APP|CHECK_APP/CUDA
70|ROBUST_CHANNEL_CE3_ERROR|CE3: Unknown Error|RESTART_APP|CONTACT_SUPPORT
71|ROBUST_CHANNEL_CE4_ERROR|CE4: Unknown Error|RESTART_APP|CONTACT_SUPPORT
72|ROBUST_CHANNEL_CE5_ERROR|CE5: Unknown Error|RESTART_APP|CONTACT_SUPPORT
73|ROBUST_CHANNEL_NVENC2_ERROR|Unused|CONTACT_SUPPORT|
74|NVLINK_ERROR|NVLINK Error|WORKFLOW_NVLINK_ERR|CONTACT_SUPPORT
75|ROBUST_CHANNEL_CE6_ERROR|CE6: Unknown Error|RESTART_APP|CONTACT_SUPPORT
76|ROBUST_CHANNEL_CE7_ERROR|CE7: Unknown Error|RESTART_APP|CONTACT_SUPPORT
77|ROBUST_CHANNEL_CE8_ERROR|CE8: Unknown Error|RESTART_APP|CONTACT_SUPPORT
78|VGPU_START_ERROR|vGPU Start Error|UPDATE_SWFW|UPDATE_SWFW
79|ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS|GPU has fallen off the bus|RESTART_BM|CONTACT_SUPPORT
80|PBDMA_PUSHBUFFER_CRC_MISMATCH|Corrupted data sent to GPU|RESTART_APP|CHECK_APP/CUDA
81|ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR|Unused|CONTACT_SUPPORT|
82|ROBUST_CHANNEL_NVJPG0_ERROR|NVJPG0 Error|RESTART_APP|CONTACT_SUPPORT
83|ROBUST_CHANNEL_NVDEC1_ERROR|NVDEC1 Error|RESTART_APP|CONTACT_SUPPORT
84|ROBUST_CHANNEL_NVDEC2_ERROR|NVDEC2 Error|RESTART_APP|CONTACT_SUPPORT
85|ROBUST_CHANNEL_CE9_ERROR|CE9: Unknown Error|RESTART_APP|CONTACT_SUPPORT
86|ROBUST_CHANNEL_OFA0_ERROR|OFA Exception|RESTART_APP|CONTACT_SUPPORT
87|NVTELEMETRY_DRIVER_REPORT|Unused|CONTACT_SUPPORT|
88|ROBUST_CHANNEL_NVDEC3_ERROR|NVDEC3 Error|RESTART_APP|CONTACT_SUPPORT
89|ROBUST_CHANNEL_NVDEC4_ERROR|NVDEC4 Error|RESTART_APP|CONTACT_SUPPORT
90|LTC_ERROR|Unused|CONTACT_SUPPORT|
91|RESERVED_XID|Unused|CONTACT_SUPPORT|
92|EXCESSIVE_SBE_INTERRUPTS|High single-bit ECC error rate|IGNORE|CONTACT_SUPPORT
93|INFOROM_ERASE_LIMIT_EXCEEDED|Non-fatal violation of provisioned InfoROM wear limit|IGNORE|CONTACT_SUPPORT
94|ROBUST_CHANNEL_CONTAINED_ERROR|Contained memory error|RESTART_APP|IGNORE (sympathetic)
95|ROBUST_CHANNEL_UNCONTAINED_ERROR|Uncontained memory error|RESET_GPU|IGNORE (sympathetic)
96|ROBUST_CHANNEL_NVDEC5_ERROR|NVDEC5 Error|RESTART_APP|CONTACT_SUPPORT
97|ROBUST_CHANNEL_NVDEC6_ERROR|NVDEC6 Error|RESTART_APP|CONTACT_SUPPORT
98|ROBUST_CHANNEL_NVDEC7_ERROR|NVDEC7 Error|RESTART_APP|CONTACT_SUPPORT
99|ROBUST_CHANNEL_NVJPG1_ERROR|NVJPG1 Error|RESTART_APP|CONTACT_SUPPORT
100|ROBUST_CHANNEL_NVJPG2_ERROR|NVJPG2 Error|RESTART_APP|CONTACT_SUPPORT
101|ROBUST_CHANNEL_NVJPG3_ERROR|NVJPG3 Error|RESTART_APP|CONTACT_SUPPORT
102|ROBUST_CHANNEL_NVJPG4_ERROR|NVJPG4 Error|RESTART_APP|CONTACT_SUPPORT
103|ROBUST_CHANNEL_NVJPG5_ERROR|NVJPG5 Error|RESTART_APP|CONTACT_SUPPORT
104|ROBUST_CHANNEL_NVJPG6_ERROR|NVJPG6 Error|RESTART_APP|CONTACT_SUPPORT
105|ROBUST_CHANNEL_NVJPG7_ERROR|NVJPG7 Error|RESTART_APP|CONTACT_SUPPORT
106|SMBPBI_TEST_MESSAGE|SMBPBI Test Message|IGNORE|IGNORE
107|SMBPBI_TEST_MESSAGE_SILENT|SMBPBI Test Message Silent|IGNORE|IGNORE
108|NVLINK_REMOTE_TRANSLATION_ERROR|Unused|IGNORE|XID_137_FLOW
109|ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR|Context Switch Timeout Error|RESET_GPU|CONTACT_SUPPORT
110|SEC_FAULT_ERROR|Security Fault Error|RESET_GPU|INVESTIGATE_SW
111|BUNDLE_ERROR_EVENT|Unused|CONTACT_SUPPORT|
112|DISP_SUPERVISOR_ERROR|Unused|CONTACT_SUPPORT|
113|DP_LT_FAILURE|Unused|CONTACT_SUPPORT|
114|HEAD_RG_UNDERFLOW|Unused|CONTACT_SUPPORT|
115|CORE_CHANNEL_REGS|Unused|CONTACT_SUPPORT|
116|WINDOW_CHANNEL_REGS|Unused|CONTACT_SUPPORT|
117|CURSOR_CHANNEL_REGS|Unused|CONTACT_SUPPORT|
118|HEAD_REGS|Unused|CONTACT_SUPPORT|
119|GSP_RPC_TIMEOUT|GSP RPC Timeout|RESET_GPU|INVESTIGATE_SW
120|GSP_ERROR|GSP Error|RESET_GPU|INVESTIGATE_SW
121|C2C_ERROR|C2C Error|IGNORE|CONTACT_SUPPORT
122|SPI_PMU_RPC_READ_FAIL|Unused|CONTACT_SUPPORT|
123|SPI_PMU_RPC_WRITE_FAIL|Unused|CONTACT_SUPPORT|
124|SPI_PMU_RPC_ERASE_FAIL|Unused|CONTACT_SUPPORT|
125|INFOROM_FS_ERROR|Unused|CONTACT_SUPPORT|
126|ROBUST_CHANNEL_CE10_ERROR|CE10: Unknown Error|RESTART_APP|CONTACT_SUPPORT
127|ROBUST_CHANNEL_CE11_ERROR|CE11: Unknown Error|RESTART_APP|CONTACT_SUPPORT
128|ROBUST_CHANNEL_CE12_ERROR|CE12: Unknown Error|RESTART_APP|CONTACT_SUPPORT
129|ROBUST_CHANNEL_CE13_ERROR|CE13: Unknown Error|RESTART_APP|CONTACT_SUPPORT
130|ROBUST_CHANNEL_CE14_ERROR|CE14: Unknown Error|RESTART_APP|CONTACT_SUPPORT
131|ROBUST_CHANNEL_CE15_ERROR|CE15: Unknown Error|RESTART_APP|CONTACT_SUPPORT
132|ROBUST_CHANNEL_CE16_ERROR|CE16: Unknown Error|RESTART_APP|CONTACT_SUPPORT
133|ROBUST_CHANNEL_CE17_ERROR|CE17: Unknown Error|RESTART_APP|CONTACT_SUPPORT
134|ROBUST_CHANNEL_CE18_ERROR|CE18: Unknown Error|RESTART_APP|CONTACT_SUPPORT
135|ROBUST_CHANNEL_CE19_ERROR|CE19: Unknown Error|RESTART_APP|CONTACT_SUPPORT
136|ALI_TRAINING_FAIL|Link Training Failed|RESET_GPU|INVESTIGATE_LINK_SI
137|NVLINK_PRIV_ERR|NVLink Privilege Error|IGNORE|XID_137_FLOW
138|ROBUST_CHANNEL_DLA_ERROR|Unused|CONTACT_SUPPORT|
139|ROBUST_CHANNEL_OFA1_ERROR|OFA1 Error|RESTART_APP|CONTACT_SUPPORT
140|UNRECOVERABLE_ECC_ERROR_ESCAPE|ECC Unrecovered Error|RESET_GPU|CONTACT_SUPPORT
141|ROBUST_CHANNEL_FAST_PATH_ERROR|CUDA Fast Path Error|IGNORE|CONTACT_SUPPORT
142|ROBUST_CHANNEL_NVENC3_ERROR|NVENC3 Error|CONTACT_SUPPORT|
143|GPU_INIT_ERROR|GPU Initialization Error|RESET_GPU|CONTACT_SUPPORT
144|NVLINK_SAW_ERROR|NVLINK: SAW Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
145|NVLINK_RLW_ERROR|NVLINK: RLW Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
146|NVLINK_TLW_ERROR|NVLINK: TLW Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
147|NVLINK_TREX_ERROR|NVLINK: TREX Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
148|NVLINK_NVLPW_CTRL_ERROR|NVLINK: NVLPW_CTRL Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
149|NVLINK_NETIR_ERROR|NVLINK: NETIR Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
150|NVLINK_MSE_ERROR|NVLINK: MSE Error|WORKFLOW_NVLINK5_ERR|WORKFLOW_NVLINK5_ERR
151|ROBUST_CHANNEL_KEY_ROTATION_ERROR|Key rotation Error|RESTART_VM|CONTACT_SUPPORT
152|ROBUST_CHANNEL_DLA_SMMU_ERROR|DLA SMMU Error|IGNORE|CONTACT_SUPPORT
153|ROBUST_CHANNEL_DLA_TIMEOUT|DLA timeout Error|IGNORE|CONTACT_SUPPORT
154|GPU_RECOVERY_ACTION_CHANGED|GPU Recovery Action Changed|XID_154|
155|NVLINK_SW_DEFINED_ERROR|NVLINK: SW Defined Error|RESET_GPU|INVESTIGATE_SW_USER
156|RESOURCE_RETIREMENT_EVENT|Resource Retirement Event|RESET_GPU|IGNORE
157|RESOURCE_RETIREMENT_FAILURE|Resource Retirement Failure|IGNORE|CONTACT_SUPPORT
158|GPU_FATAL_TIMEOUT|GPU Fatal Timeout|RESET_GPU|CONTACT_SUPPORT
159|ROBUST_CHANNEL_CHI_NON_DATA_ERROR|CHI Non-Data Error|CHECK_UVM|SYMPATHETIC_REPORT_SOLO
160|CHANNEL_RETIREMENT_EVENT|Channel Retirement Event|IGNORE|INVESTIGATE_SW
161|CHANNEL_RETIREMENT_FAILURE|Channel Retirement Failure|IGNORE|INVESTIGATE_SW
162|PSHC_REENGAGED|Power Smoothing HW Circuitry capability reengaged||
163|PSHC_DISENGAGED|Power Smoothing HW Circuitry capability disengaged||
164|PSHC_LOW_LIFETIME|Power Smoothing HW Circuitry low lifetime reached||
165|PSHC_ZERO_LIFETIME|Power Smoothing HW Circuitry lifetime exhausted||
166|NVLINK_SECURE_CRYPTO_ERR|CC traffic seen prior to link properly being configured for encrypted traffic||
167|PCIE_FATAL_TIMEOUT|PCIE_FATAL_TIMEOUT||
168|REDUCED_GPU_MEMORY_CAPACITY|Errors found in WPR (write protected region)||
169|SEC2_HALT_ERROR|Internal micro-controller halt||
170|NVLINK_SECURE_OTHER|Interrupt seen in CC mode||
171|UNCORRECTABLE_DRAM_ERROR|Uncorrectable DRAM error (details added to an Xid 48)||
172|UNCORRECTABLE_SRAM_ERROR|Uncorrectable SRAM error (details added to an Xid 48)||
"""

#: the catalog's advice for codes without a bucket, in short
_NOTES = {
    163: "no GPU reset needed; resolve the thermal events if power smoothing is wanted (timeout: reload the driver)",
    164: "power smoothing will be disabled soon: watch power swings; plan to replace the GPU if it is wanted",
    165: "power smoothing is disabled and power swings will occur; replace the GPU if they are not acceptable",
    166: "confidential-computing mode only",
    168: "seen only with ECC disabled: enable ECC (row remapping) or boot again",
    170: "confidential-computing mode only",
    171: "follow the Xid 48 it accompanies",
    172: "follow the Xid 48 it accompanies",
}


def _load() -> dict[int, XidEntry]:
    out: dict[int, XidEntry] = {}
    for row in _TABLE.strip().splitlines():
        code, mnemonic, description, immediate, investigatory = row.split("|")
        out[int(code)] = XidEntry(int(code), mnemonic, description, immediate, investigatory,
                                  _NOTES.get(int(code), ""))
    return out


CATALOG: dict[int, XidEntry] = _load()
CAUSED_BY_RE = re.compile(r"caused by previous Xid (\d+)")
NONFATAL_RE = re.compile(r"\bnon-?fatal\b", re.I)
RECOVERY_RE = re.compile(r"recovery action changed from .*? to (0x[0-9a-f]+) \(([^)]*)\)", re.I)


@dataclass(frozen=True)
class XidVerdict:
    meaning: str       # what the code is
    status: str        # fail (the node leaves service) | warn
    action: str        # what to do, after NVIDIA's buckets
    known: bool        # in NVIDIA's catalog


def action_text(e: XidEntry) -> str:
    """NVIDIA's immediate action, then the investigatory one where it differs, in words."""
    first = e.note or BUCKETS.get(e.immediate, e.immediate)
    head = f"{e.immediate}: {first}" if e.immediate else first
    if e.investigatory and e.investigatory != e.immediate:
        return f"{head}; if it recurs: {e.investigatory} ({BUCKETS.get(e.investigatory, e.investigatory)})"
    return head


def verdict(code: int, message: str = "") -> XidVerdict:
    """NVIDIA's catalog entry for `code`, with the status preflight gives it (the module docstring says why).
    The message refines three codes as the catalog asks: 45 follows the Xid it was caused by, 154 the
    recovery action it names, and the NVLink5 codes 144-150 say themselves whether they were fatal."""
    e = CATALOG.get(code)
    if e is None:
        return XidVerdict(f"unknown Xid {code} (not in NVIDIA's catalog)", "warn",
                          f"not in {CATALOG_URL}: look it up for this driver; run dcgmi diag -r 3 before reuse", False)
    meaning = e.description if e.description != "Unused" else f"{e.mnemonic} (unused on current GPUs)"
    status = "fail" if e.immediate in OUT_OF_SERVICE or code in AZURE_CRITICAL else "warn"
    action = action_text(e)
    m = CAUSED_BY_RE.search(message)
    if code == 45 and m and int(m.group(1)) in CATALOG and int(m.group(1)) != 45:
        cause = verdict(int(m.group(1)))
        return XidVerdict(f"cleanup after Xid {m.group(1)} ({cause.meaning})", cause.status, cause.action, True)
    if code == 154 and (r := RECOVERY_RE.search(message)):
        none = r.group(2).strip().lower() == "none"
        return XidVerdict(f"{meaning}: {r.group(2)}", "warn" if none else "fail",
                          "no recovery needed" if none else f"{r.group(2)} (the driver's recovery action)", True)
    if code == 154:
        status = "fail"  # a recovery action changed, and the message does not say to what: assume one is needed
    if 144 <= code <= 150 and NONFATAL_RE.search(message):
        return XidVerdict(f"{meaning} (non-fatal)", "fail" if code in AZURE_CRITICAL else "warn", action, True)
    return XidVerdict(meaning, status, action, True)
