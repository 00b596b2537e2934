{{/* Names and labels shared by every object of the chart. */}}

{{- define "gpuledger.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's object name: "RELEASE-gpuledger", or just RELEASE when it already says gpuledger. */}}
{{- define "gpuledger.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpuledger.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuledger.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuledger.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpuledger.labels" -}}
helm.sh/chart: {{ include "gpuledger.chart" . }}
{{ include "gpuledger.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: agent
app.kubernetes.io/part-of: gpuledger
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "gpuledger.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpuledger.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpuledger.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The port the agent listens on: the port of config.listen (HOST:PORT), so the two cannot disagree. */}}
{{- define "gpuledger.port" -}}
{{- $listen := .Values.config.listen | default "0.0.0.0:9835" | toString }}
{{- $parts := splitList ":" $listen }}
{{- last $parts | int }}
{{- end }}

{{/* In-container paths, taken from the agent's config so the mounts and the config always agree. */}}
{{- define "gpuledger.procRoot" -}}
{{- required "config.proc_root must be set: the path the host's /proc is mounted at" .Values.config.proc_root }}
{{- end }}

{{- define "gpuledger.passwdFile" -}}
{{- required "config.attribution.passwd_file must be set: the path the host's /etc/passwd is mounted at" .Values.config.attribution.passwd_file }}
{{- end }}

{{- define "gpuledger.podResourcesDir" -}}
{{- dir (required "config.attribution.podresources_socket must be set" .Values.config.attribution.podresources_socket) }}
{{- end }}

{{- define "gpuledger.podLogsDir" -}}
{{- required "config.attribution.pod_logs_dir must be set" .Values.config.attribution.pod_logs_dir }}
{{- end }}

{{- define "gpuledger.ledgerDir" -}}
{{- dir (required "config.ledger.path must be set" .Values.config.ledger.path) }}
{{- end }}

{{/* The pod's affinity: the user's, or the GPU-node default while they set neither an affinity
nor a nodeSelector of their own (a nodeSelector from before the default existed would
otherwise be ANDed with terms their nodes may not match). */}}
{{- define "gpuledger.affinity" -}}
{{- if or .Values.affinity .Values.nodeSelector }}
{{- with .Values.affinity }}{{ toYaml . }}{{ end }}
{{- else }}
{{- with .Values.gpuNodeAffinity }}{{ toYaml . }}{{ end }}
{{- end }}
{{- end }}
